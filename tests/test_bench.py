"""``attnlab bench``: its tables come out whole (rows, ratio columns) on tiny runs, and bad
input is one line on stderr with exit code 2. No timing is asserted: benchmarks are not
tests."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from attnlab import benchmark as bm
from attnlab.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
RATIO = re.compile(r"\s(\d+\.\d\d)\s+(attnlab by \d+\.\d\dx|torch by \d+\.\d\dx|even)\b")
FAST = ["--repeats", "1", "--threads", "1"]


def _lines_starting(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_a_tiny_sdpa_run_prints_every_row_with_its_ratio(capsys):
    code = main(["bench", "--sections", "sdpa", "--shapes", "sweep", "--sizes", "64", *FAST])
    out = capsys.readouterr().out
    assert code == 0
    head = _lines_starting(out, "shape ")
    assert len(head) == 1
    for column in ("attnlab ms", "torch ms", "attnlab GF/s", "torch GF/s", "attnlab/torch", "faster",
                   "attnlab %SGEMM", "torch %SGEMM"):
        assert column in head[0]
    rows = _lines_starting(out, "H=8 sweep")
    assert [r.split()[3:5] for r in rows] == [["no", "fwd"], ["no", "fwd+bwd"], ["yes", "fwd"], ["yes", "fwd+bwd"]]
    assert all(r.split()[2] == "1,8,64,64" for r in rows)
    assert all(RATIO.search(r) for r in rows), rows
    assert "avx2 " in out and "avx512f " in out and "SGEMM (1024^3" in out
    assert "== layers" not in out and "== decode" not in out
    assert re.search(r"bench took \d+\.\d s", out)


def test_the_model_shapes_run_gqa_against_torch_with_enable_gqa(capsys):
    code = main(["bench", "--sections", "sdpa", "--shapes", "smollm2", "--passes", "fwd", "--naive-max", "512",
                 *FAST])
    out = capsys.readouterr().out
    assert code == 0
    (row,) = _lines_starting(out, "SmolLM2 prefill")
    assert "1,9/3,512,64" in row and " yes " in row and RATIO.search(row)
    assert "naive ms" in _lines_starting(out, "shape ")[0]  # L <= --naive-max: the naive path ran
    assert "H=8 sweep" not in out


def test_shapes_are_the_models_and_the_sweep():
    shapes = bm.sdpa_shapes([64, 256], groups=bm.SHAPE_GROUPS)
    by_name = {s.name: s for s in shapes}
    assert (by_name["MiniLM-like"].B, by_name["MiniLM-like"].Hq, by_name["MiniLM-like"].L,
            by_name["MiniLM-like"].E) == (32, 12, 128, 32)
    assert by_name["BERT-base-like"].E == 64 and not by_name["BERT-base-like"].causal
    smol = by_name["SmolLM2 prefill"]
    assert (smol.Hq, smol.H, smol.L, smol.causal, smol.gqa) == (9, 3, 512, True, True)
    gpt2 = by_name["GPT-2 small"]
    assert (gpt2.Hq, gpt2.L, gpt2.causal, gpt2.gqa) == (12, 1024, True, False)
    sweep = [(s.L, s.causal) for s in shapes if s.name == "H=8 sweep"]
    assert sweep == [(64, False), (64, True), (256, False), (256, True)]
    assert smol.flops("fwd+bwd") == 3.5 * smol.flops("fwd") == 3.5 * 4 * 9 * 512 * 512 * 64 / 2


def test_the_sdpa_rows_time_what_torch_computes():
    """The functions timed for both sides give the same output (so the ratio compares like
    with like), GQA included."""
    torch = pytest.importorskip("torch")
    shape = bm.Shape("t", 2, 6, 2, 40, 40, 16, True)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 6, 40, 16), dtype=np.float32)
    k, v = (rng.standard_normal((2, 2, 40, 16), dtype=np.float32) for _ in range(2))
    g = rng.standard_normal(q.shape, dtype=np.float32)
    ours = bm._attnlab_fn(shape, q, k, v, g, "fwd")()
    theirs = bm._torch_fn(torch, shape, q, k, v, g, "fwd")().numpy()
    assert np.abs(ours - theirs).max() < 1e-5
    gq, gk, gv = bm._attnlab_fn(shape, q, k, v, g, "fwd+bwd")()
    assert gk.shape == k.shape and gv.shape == v.shape and gq.shape == q.shape


def _tiny_gpt2_pair():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import from_torch

    torch.manual_seed(0)
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97,
                                                                  n_positions=64)).eval()
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = None
    return from_torch(theirs), theirs


def test_the_layer_rows_compare_with_torch_and_transformers(capsys):
    models = bm.Models()
    pair = _tiny_gpt2_pair()
    models.gpt2 = lambda: pair  # a tiny GPT-2 stands in for GPT-2 small
    rows = bm.layer_rows(threads=1, repeats=1, mha_tokens=16, gpt2_tokens=8, smollm2_tokens=0, minilm_texts=0,
                         train_steps=1, decode_tokens=4, settle=0.0, back_to_back=False, models=models)
    names = [r.name for r in rows]
    assert names == ["MultiheadAttention(512, 8) fwd, L=16", "MultiheadAttention(512, 8) fwd+bwd, L=16",
                     "GPT-2 small prefill, 8 tokens", "TinyTransformer training step",
                     "GPT-2 small decode, KV cache, 4 new tokens"]
    for r in rows:
        assert set(r.seconds) == {"attnlab", "torch"} and r.ratio() == r.seconds["attnlab"] / r.seconds["torch"]
    mha_diff = float(rows[0].note.rsplit(" ", 1)[1])
    assert mha_diff < 1e-5  # the same weights
    assert float(rows[2].note.rsplit(" ", 1)[1]) < 1e-4
    assert rows[3].unit == "steps/s" and rows[3].rate("attnlab") == 1 / rows[3].seconds["attnlab"]
    assert rows[4].unit == "tok/s" and rows[4].note.endswith("same tokens: yes")
    from attnlab.cli.bench import format_layer_rows

    table = format_layer_rows(rows)
    assert table.splitlines()[0].split()[:5] == ["layer", "attnlab", "other", "other", "is"]
    assert "attnlab/other" in table.splitlines()[0]
    assert " ms " in table and " steps/s " in table and " tok/s " in table
    assert sum(bool(RATIO.search(line.replace("transformers by", "torch by"))) for line in table.splitlines()) == 5


# bench runs of the turns tests: the MultiheadAttention rows alone, and the L=64 sweep forward
MHA_ONLY = ["bench", "--sections", "layers", "--layer-tokens", "16", "--prefill-tokens", "0", "--minilm-texts", "0",
            "--train-steps", "0", "--new-tokens", "0", "--threads", "1"]
SWEEP_64_FWD = ["bench", "--sections", "sdpa", "--shapes", "sweep", "--sizes", "64", "--passes", "fwd",
                "--threads", "1"]


@pytest.fixture
def turns(monkeypatch) -> list[int]:
    """The number of turns of every interleaved_times call (each then timed once); no SDPA
    cell counts as near even (their extra turns: test_sdpa_cells_near_even_take_more_turns)."""
    seen = []
    real = bm.interleaved_times

    def spy(fns, repeats, **kw):
        seen.append(repeats)
        return real(fns, 1, **kw)

    monkeypatch.setattr(bm, "interleaved_times", spy)
    monkeypatch.setattr(bm, "_close", lambda times: False)
    return seen


def test_the_mha_rows_take_their_own_number_of_turns(turns, capsys):
    """The MultiheadAttention rows' short calls are timed mha_repeats times a side (the
    quick run's default MHA_REPEATS, unless --repeats says otherwise); the other rows
    repeats times."""
    bm.layer_rows(threads=1, repeats=2, mha_tokens=16, mha_repeats=5, gpt2_tokens=0, smollm2_tokens=0,
                  minilm_texts=0, train_steps=1, decode_tokens=0, settle=0.0, back_to_back=False)
    assert turns == [5, 5, 2]
    with pytest.raises(ValueError, match="mha_repeats"):
        bm.layer_rows(threads=1, repeats=2, mha_repeats=0, mha_tokens=16, gpt2_tokens=0, smollm2_tokens=0,
                      minilm_texts=0, train_steps=0, decode_tokens=0)
    turns.clear()
    args = MHA_ONLY
    assert main(args) == 0
    assert turns == [bm.MHA_REPEATS] * 2 and bm.MHA_REPEATS > 3
    assert f"MultiheadAttention rows' short calls: median of {bm.MHA_REPEATS}" in capsys.readouterr().out
    turns.clear()
    assert main([*args, "--repeats", "2"]) == 0
    assert turns == [2, 2]
    assert "short calls" not in capsys.readouterr().out


def test_the_sdpa_cells_of_short_calls_take_their_own_number_of_turns(turns, capsys):
    """SDPA cells of at most SHORT_CALL_SCORES scores are timed short_repeats times a side
    (the quick run's default SHORT_REPEATS, unless --repeats says otherwise); larger cells
    repeats times."""
    over = int((bm.SHORT_CALL_SCORES / 8) ** 0.5) + 1  # 8 heads of over x over scores: just too many
    shapes = bm.sdpa_shapes([256, 64, over], groups=["sweep"])
    shapes = [s for s in shapes if not s.causal]
    assert [s.B * s.Hq * s.L * s.S <= bm.SHORT_CALL_SCORES for s in shapes] == [True, True, False]
    bm.run_sdpa(shapes, repeats=2, short_repeats=4, threads=1, passes=["fwd"], settle=0.0, back_to_back=False,
                sgemm_turns=False)
    assert turns == [4, 4, 2]
    with pytest.raises(ValueError, match="short_repeats"):
        bm.run_sdpa(shapes, repeats=2, short_repeats=0, threads=1, passes=["fwd"])
    turns.clear()
    args = SWEEP_64_FWD
    assert main(args) == 0
    assert turns == [bm.SHORT_REPEATS] * 2 and bm.SHORT_REPEATS > 3  # L=64, causal and not
    assert f"scores: median of {bm.SHORT_REPEATS}" in capsys.readouterr().out
    turns.clear()
    assert main([*args, "--repeats", "2"]) == 0
    assert turns == [2, 2]
    assert "scores: median" not in capsys.readouterr().out


def test_a_tiny_layer_run_end_to_end(capsys):
    code = main(["bench", "--sections", "layers", "--layer-tokens", "16", "--prefill-tokens", "0", "--minilm-texts",
                 "0", "--train-steps", "1", "--new-tokens", "0", *FAST])
    out = capsys.readouterr().out
    assert code == 0
    rows = _lines_starting(out, "MultiheadAttention") + _lines_starting(out, "TinyTransformer")
    assert len(rows) == 3 and all(RATIO.search(r) for r in rows)
    assert "GPT-2" not in out and "== decode" not in out


def test_the_decode_section_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, bm.DECODE_MODULE, None)  # its import fails
    code = main(["bench", "--sections", "decode", *FAST])
    out = capsys.readouterr().out
    assert code == 0 and "decode section: needs attnlab.decode_bench" in out


def _tiny_llama():
    from attnlab.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Llama(cfg, rng=np.random.default_rng(0))


def test_the_int8_activation_row_takes_a_model_with_quantized_weights():
    from attnlab.quant import QuantizedTensor

    quantized = _tiny_llama()
    for name, p in quantized.named_parameters():
        if name.startswith("blocks.") and p.data.ndim == 2:
            p.data = QuantizedTensor.quantize(p.data.astype(np.float32), "Q8_0")
    db = types.SimpleNamespace(load_smollm2=lambda *, quantized=True: model)
    model = quantized
    got = bm._int8_activations(db)
    assert got is quantized and {p.data.activations for _, p in got.named_parameters()
                                 if isinstance(p.data, QuantizedTensor)} == {"int8"}
    model = _tiny_llama()  # dequantized (no numba): no row to time
    assert bm._int8_activations(db) is None


def test_decode_cache_bytes_count_key_value_heads_windows_and_storage():
    from attnlab.decode_bench import decode_cache_bytes
    from attnlab.models import Llama, LlamaConfig

    # 2 layers of 2 key/value heads (of 4 query heads) of width 8; the first sees its last 4 tokens
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      sliding_windows=(4, None))
    m = Llama(cfg, rng=np.random.default_rng(0))
    row = 2 * 2 * 8  # a key row and a value row a token, in values
    assert decode_cache_bytes(m, 10) == (4 + 10) * row * 4
    assert decode_cache_bytes(m, 3, dtype="float16") == (3 + 3) * row * 2
    assert decode_cache_bytes(m, 3, dtype="int8") == (3 + 3) * (row + 2 * 2 * 4)  # codes, and a scale a head
    assert decode_cache_bytes(m, 0) == 0
    with pytest.raises(ValueError, match="cache dtype must be one of"):
        decode_cache_bytes(m, 10, dtype="int4")
    with pytest.raises(ValueError, match="context must be a non-negative int, got -1"):
        decode_cache_bytes(m, -1)


def test_the_decode_rows_share_the_bandwidth_limit(monkeypatch):
    pytest.importorskip("transformers")
    from attnlab.interop import to_torch

    if not bm._smollm2_available():
        pytest.skip("needs the SmolLM2 package")
    ours, small = _tiny_llama(), _tiny_llama()  # small: the quantized model's stand-in
    fake = types.ModuleType(bm.DECODE_MODULE)
    readings = iter([1e10, 2e10])  # before the models load, after the timings: the larger is the limit
    fake.memory_bandwidth = lambda *, threads=None: next(readings)
    fake.decode_weight_bytes = lambda model: 1000 if model is small else 4000
    fake.load_smollm2 = lambda *, quantized=True: small  # float weights: no int8-activation row
    monkeypatch.setitem(sys.modules, bm.DECODE_MODULE, fake)
    monkeypatch.setattr(bm, "_llama_cpp_fns", lambda *a: None)  # llama.cpp stays out of tests
    models = bm.Models()
    monkeypatch.setattr(models, "smollm2", lambda: ours)
    theirs = to_torch(ours).eval()
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = None
    monkeypatch.setattr(models, "smollm2_torch", lambda: theirs)
    bandwidth, rows = bm.decode_rows(threads=1, repeats=1, new_tokens=3, settle=0.0, models=models)
    assert bandwidth == 2e10
    assert [r.name.split()[0] for r in rows] == ["attnlab", "attnlab", "attnlab", "transformers", "llama.cpp"]
    timed = [rows[0], rows[1], rows[3]]
    for r in timed:
        assert r.tokens_per_s is not None
        assert r.share == pytest.approx(r.tokens_per_s * r.weight_bytes / 2e10, rel=1e-12)
    assert rows[1].weight_bytes == 1000 and rows[0].weight_bytes == rows[3].weight_bytes == 4000
    assert rows[0].note == "same tokens as transformers: yes"
    assert "int8 activations" in rows[2].name and rows[2].tokens_per_s is None and "dequantized" in rows[2].note
    assert rows[4].tokens_per_s is None and "llama_cpp" in rows[4].note
    from attnlab.cli.bench import format_decode_rows

    table = format_decode_rows(rows).splitlines()
    assert table[0].split()[:3] == ["decoder", "tok/s", "weights"] and "share of limit" in table[0]
    assert re.search(r"\d+%", table[1])
    assert table[5].startswith("llama.cpp") and re.search(r"stored\)\s+-\s", table[5])  # no rate


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--sizes", "12,x"], "--sizes must be comma-separated integers"),
        (["--sizes", "1.5"], "--sizes must be comma-separated integers"),
        (["--sizes", "0"], "--sizes must be positive"),
        (["--sizes", "64,-8"], "--sizes must be positive"),
        (["--sizes", ""], "--sizes needs at least one value"),
        (["--sizes", " , "], "--sizes needs at least one value"),
        (["--sizes", "10000000000"], "--sizes: L=10000000000 needs about"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--repeats", "-3"], "--repeats must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--threads", "-2"], "--threads must be >= 1"),
        (["--threads", "4096"], "is more than the"),
        (["--sections", ""], "--sections needs at least one of sdpa,layers,decode"),
        (["--sections", "sdpa,gpu"], "--sections: unknown 'gpu'"),
        (["--shapes", "llama9"], "--shapes: unknown 'llama9'"),
        (["--memory-tokens", "-1"], "--memory-tokens must be >= 0"),
        (["--memory-tokens", "100000000000"], "--memory-tokens 100000000000 needs about"),
        (["--layer-tokens", "1000000000"], "--layer-tokens 1000000000 needs about"),
        (["--naive-max", "-1"], "--naive-max must be >= 0"),
        (["--minilm-texts", "-1"], "--minilm-texts must be >= 0"),
        (["--train-steps", "-1"], "--train-steps must be >= 0"),
        (["--prefill-tokens", "2000"], "--prefill-tokens must be at most 1024"),
        (["--new-tokens", "5000"], "--new-tokens must be at most 992"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_code_2(argv, match, capsys):
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and match in err and err.startswith("attnlab bench: error:")
    assert captured.out == ""  # nothing half-printed


@pytest.mark.parametrize("argv", [["--threads", "two"], ["--repeats", "1.5"], ["--passes", "sideways"],
                                  ["--sizes"]])
def test_unparseable_options_are_one_line_without_a_traceback(argv):
    done = subprocess.run([sys.executable, "-m", "attnlab", "bench", *argv], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "attnlab bench: error:" in done.stderr
    assert "Traceback" not in done.stderr


def test_decode_time_never_goes_negative():
    assert bm.decode_seconds(1.0, 0.4) == pytest.approx(0.6)
    assert bm.decode_seconds(1.0, 1.2) == 0.1  # noise: the prompt measured longer than the whole call


def test_faster_names_the_other_side():
    from attnlab.cli.bench import faster

    assert faster(0.5, "transformers") == "attnlab by 2.00x"
    assert faster(3.0, "sentence-transformers") == "sentence-transformers by 3.00x"
    assert faster(None) == "-"


def test_sdpa_cells_near_even_take_more_turns(monkeypatch, capsys):
    """A cell whose attnlab/torch median lands within CLOSE_BAND of even, on either side,
    takes close_repeats more turns (no second warm-up), and its medians cover all of them;
    a cell outside the band, or a run without close_repeats, takes none."""
    calls = []
    first = iter([1.05, 0.95, 0.85, 1.2, 1.05])  # attnlab's time per cell; torch's is 1.0

    def fake(fns, repeats, *, warmup=True, **kw):
        calls.append((repeats, warmup))
        if warmup:
            a = next(first)
            return {name: [a if name == "attnlab" else 1.0] * repeats for name in fns}
        return {name: [0.5 if name == "attnlab" else 0.6] * repeats for name in fns}  # the extra turns

    monkeypatch.setattr(bm, "interleaved_times", fake)
    shapes = bm.sdpa_shapes([16, 32], groups=["sweep"])
    assert len(shapes) == 4
    rows = bm.run_sdpa(shapes, repeats=2, close_repeats=4, threads=1, passes=["fwd"], back_to_back=False,
                       sgemm_turns=False)
    assert calls == [(2, True), (4, False), (2, True), (4, False), (2, True), (2, True)]
    assert [r.extra_turns for r in rows] == [4, 4, 0, 0]
    assert rows[0].seconds["attnlab"] == 0.5 and rows[0].seconds["torch"] == 0.6  # medians of 2 + 4 turns
    assert rows[2].seconds["attnlab"] == 0.85 and rows[3].seconds["attnlab"] == 1.2
    calls.clear()
    rows = bm.run_sdpa(shapes[:1], repeats=2, threads=1, passes=["fwd"], back_to_back=False, sgemm_turns=False)
    assert calls == [(2, True)] and rows[0].extra_turns == 0
    with pytest.raises(ValueError, match="close_repeats"):
        bm.run_sdpa(shapes, repeats=2, close_repeats=-1, threads=1, passes=["fwd"])

    seen = []
    monkeypatch.setattr(bm, "interleaved_times", lambda fns, repeats, **kw: seen.append(repeats) or
                        {name: [1.0] * repeats for name in fns})
    args = SWEEP_64_FWD
    assert main(args) == 0
    assert seen == [bm.SHORT_REPEATS, bm.CLOSE_REPEATS] * 2 and bm.CLOSE_REPEATS > 0
    out = capsys.readouterr().out
    assert f"within {bm.CLOSE_BAND:.0%} of even after its runs: {bm.CLOSE_REPEATS} more" in out
    assert "more a side (medians over all): H=8 sweep L=64 fwd; H=8 sweep L=64 causal fwd" in out
    seen.clear()
    assert main([*args, "--repeats", "2"]) == 0
    assert seen == [2, 2]
    assert "of even" not in capsys.readouterr().out


def test_layer_rows_near_even_take_more_turns(monkeypatch, capsys):
    """The layer rows follow the SDPA cells' rule: the forward row lands near even and
    takes close_repeats more turns, the forward+backward row does not; the section's footer
    names the one that did."""
    calls = []
    attnlab = iter([0.92, 0.8, 0.7])  # attnlab's time per call of interleaved_times; torch's is 1.0

    def fake(fns, repeats, *, warmup=True, **kw):
        calls.append((repeats, warmup))
        a = next(attnlab)
        return {name: [a if name == "attnlab" else 1.0] * repeats for name in fns}

    monkeypatch.setattr(bm, "interleaved_times", fake)
    rows = bm.layer_rows(threads=1, repeats=2, mha_tokens=16, mha_repeats=3, close_repeats=5, gpt2_tokens=0,
                         smollm2_tokens=0, minilm_texts=0, train_steps=0, decode_tokens=0, back_to_back=False)
    assert [n for n, _ in calls] == [3, 5, 3] and calls[1][1] is False  # no warm-up before the extra turns
    assert [r.extra_turns for r in rows] == [5, 0]
    assert rows[0].ratio() == pytest.approx(0.8) and rows[1].ratio() == pytest.approx(0.7)
    with pytest.raises(ValueError, match="close_repeats"):
        bm.layer_rows(threads=1, repeats=2, close_repeats=-2, mha_tokens=16, gpt2_tokens=0, smollm2_tokens=0,
                      minilm_texts=0, train_steps=0, decode_tokens=0)
    attnlab = iter([0.92, 0.8, 0.7])
    args = MHA_ONLY
    assert main(args) == 0
    assert "medians over all): MultiheadAttention(512, 8) fwd, L=16\n" in capsys.readouterr().out


def test_turns_pause_less_after_torch_and_can_skip_the_warm_up(monkeypatch):
    pauses, calls = [], []
    monkeypatch.setattr(bm.time, "sleep", pauses.append)
    fns = {"attnlab": lambda: calls.append("a"), "torch": lambda: calls.append("t")}
    times = bm.interleaved_medians(fns, 2, settle=0.1, settle_after=bm._settle_after(0.02), warmup=False)
    assert pauses == [0.1, 0.1, 0.02, 0.1] and calls == ["a", "t", "a", "t"]
    assert set(times) == {"attnlab", "torch"}
    bm.interleaved_medians(fns, 1, settle=0.1)
    assert calls[4:] == ["a", "t", "a", "t"] and pauses[4:] == [0.1, 0.1]  # warm-up calls, then timed ones


# ---- --explain-dispatch: which kernel runs for a shape, and why (the CPU pinned) ----------


@pytest.mark.parametrize("cpu, shape, forward, backward", [
    ("zen4", "1,8,4096,64", "blockwise", "rows"),  # 1 MiB L2: 4096 keys fit the backward's blocks only...
    ("avx2-512k", "1,8,4096,64", "blockwise", "blockwise"),  # ...a 512 KiB L2 holds neither
    ("xeon-avx512", "1,8,4096,64", "rows", "rows"),
    ("zen4", "1,8,2048,64,float64", "blockwise", "blockwise"),
    ("xeon-avx512", "1,1,520,8,530,causal,float64", "naive", "naive"),
    ("avx2-512k", "1,1,520,8,530,causal,float64", "blockwise", "blockwise"),
])
def test_explain_dispatch_names_the_kernel_and_why(capsys, pin_cpu, cpu, shape, forward, backward):
    pin_cpu(cpu)
    assert main(["bench", "--explain-dispatch", shape]) == 0
    out = capsys.readouterr().out
    assert f"(described, not this machine: {cpu})" in out.splitlines()[0]
    assert f"forward: kernel {forward}" in out and f"backward: kernel {backward}" in out
    assert "tuning: figures: pool call 80 us, one thread's SGEMM 100 GFLOP/s (typical figures, not measured)" in out
    if forward == "rows":
        assert re.search(r"blocks of \d+ query row\(s\) x \d+ head\(s\)", out)
    if forward == "blockwise":
        assert re.search(r"tiles of 512 x \d+", out)


def test_explain_dispatch_names_the_int8_dot_products(capsys):
    """The quantized products' instructions come from numba's target (never the described
    CPU): the line names them where numba is there, and is absent where it is not."""
    from attnlab.core.blockwise import fused_available, tuned

    assert main(["bench", "--explain-dispatch", "1,2,64,64"]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("quantized weights with int8 activations")]
    if fused_available():
        from attnlab import _quant_kernels as qk

        assert line == ["quantized weights with int8 activations (this machine's numba target): "
                        + qk.explain_int8_dots(qk.INT8_DOT_ISA)]
        assert "vpdpbusd" in qk.explain_int8_dots("vnni") and "vpmaddubsw" in qk.explain_int8_dots("avx2")
        assert "scalar" in qk.explain_int8_dots("scalar")
    with tuned(fused=False):
        assert main(["bench", "--explain-dispatch", "1,2,64,64"]) == 0
    assert "int8 activations" not in capsys.readouterr().out


def test_explain_dispatch_follows_the_l2_cache(capsys, pin_cpu):
    """The rows kernel's reach: scores of 512 query rows in 4x the L2 forward."""
    pin_cpu("zen4,l2=256K")
    assert main(["bench", "--explain-dispatch", "1,8,1024,64"]) == 0
    out = capsys.readouterr().out
    assert "forward: kernel blockwise" in out and "1024 keys > 512" in out and "the 256 KiB L2" in out


@pytest.mark.parametrize("shape, match", [
    ("1,8,x,64", "must be integers"),
    ("1,8,64", "a shape is one of minilm, bert, smollm2, gpt2 or B,H,L,E"),
    ("1,9/2,64,64", "Hq a multiple of Hkv"),
    ("1,0,64,64", "every size must be positive"),
])
def test_explain_dispatch_bad_shapes(capsys, shape, match):
    assert main(["bench", "--explain-dispatch", shape]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--explain-dispatch: " in err and match in err


GPU_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


def test_the_gpu_benchmark_runs_its_comparisons_on_cpu_tensors():
    """``benchmarks/gpu.py --device cpu --quick``: every section prints (the GPU-only memory
    section says it is skipped), attnlab's errors against float64 are torch's order, the
    decoder agrees with transformers. CI has no GPU; this keeps the script working."""
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, str(GPU_SCRIPT), "--device", "cpu", "--quick", "--repeat", "1",
                          "--skip", "jax,cupy"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    dtypes = ("| float32 |", "| bfloat16 |", "| float16 |")
    rows = [line for line in out.splitlines() if line.startswith("| ") and any(d in line for d in dtypes)]
    assert len(rows) == 12  # 4 shapes x 3 dtypes
    for row in rows:
        err_ratio = float(row.rstrip(" |").rsplit("|", 1)[-1])
        assert err_ratio < 1.6, row  # attnlab's largest error against float64 over torch's
    assert "(memory: CUDA only, skipped)" in out
    assert re.search(r"MultiheadAttention\(512, 8\).*largest difference \d\.\de-0[78]", out, re.S)
    assert re.search(r"logits within \d\.\de-0[67] of the largest", out)
    assert "first 8 of 8 greedy tokens the same" in out


@pytest.mark.parametrize("args, message", [
    (["--device", "no-such-device"], "torch cannot use device 'no-such-device' here"),
    (["--device", "cpu", "--skip", "sdpa,flash"], "--skip names no section ['flash']"),
    (["--device", "cpu", "--new", "1"], "--new must be at least 2, got 1"),
])
def test_the_gpu_benchmark_refuses_bad_arguments_in_one_line(args, message):
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, str(GPU_SCRIPT), *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


ATTENTION_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_attention.py"


@pytest.mark.parametrize("dtype, size", [("float16", "0.5 MB"), ("int8", "0.2 MB")])
def test_the_decode_attention_benchmark_compares_with_torch_and_float64(dtype, size):
    """``benchmarks/decode_attention.py`` on a small float16 or int8 cache: attnlab's and
    torch's rows, each within float32 round-off of the float64 reference (of the values the
    cache holds), and the memory's limit."""
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, str(ATTENTION_SCRIPT), "--keys", "301", "--layers", "2", "--repeat", "1",
                          "--threads", "2", "--cache-dtype", dtype], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert f"2 layers x 301 cached tokens, 9 query heads over 3 key/value heads of 64, {dtype} cache: {size}" in out
    assert re.search(r"\d+\.\d GB/s before the steps, \d+\.\d after; at \d+\.\d, at best \d+\.\d\d ms a step", out)
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^  (attnlab|torch float32) .* (\d\.\de-\d\d)$", out, re.M)}
    assert set(rows) == {"attnlab", "torch float32"}, out
    assert all(diff < 1e-6 for diff in rows.values()), rows


LONG_CONTEXT_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


def _long_context(*args, timeout=300):
    return subprocess.run([sys.executable, str(LONG_CONTEXT_SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": SRC})


def test_the_long_context_benchmark_times_each_context_in_turns():
    """``benchmarks/long_context.py`` on SmolLM2 with two short contexts: a row for each,
    sorted, the longer one's rate over the shorter's, and the rounds' range around it; the
    same for llama.cpp where it imports (a benchmark anchor, not in the test extra)."""
    if not bm._smollm2_available():
        pytest.skip("needs the SmolLM2 package")
    run = _long_context("--contexts", "24,8", "--steps", "2", "--rounds", "2", "--threads", "1",
                        "--cache-dtype", "int8")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "decode step after each context, int8 cache, batch 1" in out and "2 rounds of 2 steps" in out
    rate = r"(?: +(\d+\.\d\d) +(\d+\.\d\d)-(\d+\.\d\d))?"  # the longer context's: rate, rounds' least-most
    rows = re.findall(r"^  (attnlab|llama\.cpp) +(\d+) +(\d+\.\d\d) +(\d+\.\d)" + rate + "$", out, re.M)
    anchored = importlib.util.find_spec("llama_cpp") is not None
    assert ("llama.cpp: the same GGUF file, Q8_0 cache" in out) == anchored, out
    assert ("llama.cpp: left out (llama-cpp-python does not import)" in out) != anchored, out
    names = ["attnlab", "llama.cpp"] if anchored else ["attnlab"]
    assert [(r[0], r[1]) for r in rows] == [(name, c) for name in names for c in ("8", "24")], out
    for short, long in zip(rows[::2], rows[1::2], strict=True):
        assert short[4] == "" and long[4] != ""
        assert float(long[4]) == pytest.approx(float(short[2]) / float(long[2]), abs=0.02)
        assert float(long[5]) <= float(long[6])
    reads = re.search(r"^bytes a step reads \(weights and cache\): (\d+\.\d) MB after 8, (\d+\.\d) MB after 24$",
                      out, re.M)
    assert reads and float(reads[1]) < float(reads[2]), out
    bound = re.search(r"^a step bound by the memory alone keeps (\d\.\d\d) of its rate after 24 tokens$", out, re.M)
    assert bound and float(bound[1]) == pytest.approx(float(reads[1]) / float(reads[2]), abs=0.01), out


def test_the_long_context_benchmark_leaves_llama_cpp_out_when_asked():
    if not bm._smollm2_available():
        pytest.skip("needs the SmolLM2 package")
    run = _long_context("--contexts", "8,16", "--steps", "1", "--rounds", "1", "--threads", "1", "--no-llama-cpp")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "llama.cpp: left out (--no-llama-cpp)" in run.stdout
    assert re.findall(r"^  (\w\S*) +\d+ +\d+\.\d\d", run.stdout, re.M) == ["attnlab", "attnlab"], run.stdout


@pytest.mark.parametrize("args, message", [
    (["--contexts", "100,x"], "--contexts must be comma-separated whole numbers, got '100,x'"),
    (["--contexts", "0,100"], "--contexts must each be at least 1, got '0,100'"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--cache-dtype", "int4"], "--cache-dtype must be float32, float16 or int8, got 'int4'"),
    (["--rounds", "two"], "argument --rounds: invalid int value: 'two'"),
])
def test_the_long_context_benchmark_refuses_bad_arguments_in_one_line(args, message):
    run = _long_context(*args, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def test_the_long_context_benchmark_refuses_a_context_beyond_the_model():
    if not bm._smollm2_available():
        pytest.skip("needs the SmolLM2 package")
    run = _long_context("--contexts", "100,100000")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "--contexts go up to" in run.stderr and "got 100000" in run.stderr


@pytest.mark.parametrize("args, message", [
    (["--keys", "0"], "--keys must be at least 1, got 0"),
    (["--cache-dtype", "int4"], "--cache-dtype must be float32, float16 or int8, got 'int4'"),
    (["--layers", "many"], "argument --layers: invalid int value: 'many'"),
])
def test_the_decode_attention_benchmark_refuses_bad_arguments_in_one_line(args, message):
    run = subprocess.run([sys.executable, str(ATTENTION_SCRIPT), *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
