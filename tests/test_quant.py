"""Quantized weights kept quantized (attnlab.quant): the blocks against the gguf package's
dequantization, every product path against ``x @ dequantize(W).T``, the layout checks,
and SmolLM2 loaded quantized against the same file dequantized to float32."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.core.blockwise import fused_available, tuned
from attnlab.quant import KINDS, MATVEC_MAX_ROWS, QuantizedTensor, quantized_linear, stack_rows

SHAPES = [(16, 32), (48, 96), (100, 64), (7, 160)]
ROWS = [1, 3, MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, 40]  # decode (the kernel) and prefill (BLAS)


def random_blocks(rng, kind: str, shape) -> bytes:
    """Valid random GGUF blocks: float16 scales (and mins) of moderate size, random codes."""
    R, K = shape
    n = R * K // 32
    head = rng.uniform(-0.05, 0.05, (n, 2 if kind == "Q4_1" else 1)).astype(np.float16).view(np.uint8)
    codes = rng.integers(0, 256, (n, KINDS[kind] - head.shape[1]), dtype=np.uint8)
    return np.concatenate([head, codes], axis=1).tobytes()


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_equals_the_gguf_package(kind):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        raw = random_blocks(rng, kind, shape)
        w = QuantizedTensor.from_bytes(raw, kind, shape, name="w")
        ref = gguf.quants.dequantize(np.frombuffer(raw, dtype=np.uint8).reshape(shape[0], -1),
                                     getattr(gguf.GGMLQuantizationType, kind))
        np.testing.assert_array_equal(w.dequantize(), ref)
        np.testing.assert_array_equal(w.dequantize(slice(1, 4)), ref[1:4])
        ids = np.array([[2, 0], [2, 5]]) % shape[0]
        np.testing.assert_array_equal(w.rows_of(ids), ref[ids])


@pytest.mark.parametrize("kind", list(KINDS))
def test_products_equal_the_dequantized_product(kind, compiled):
    rng = np.random.default_rng(2)
    for shape in SHAPES:
        w = QuantizedTensor.from_bytes(random_blocks(rng, kind, shape), kind, shape)
        dense = w.dequantize().astype(np.float64)
        bias = rng.standard_normal(shape[0]).astype(np.float32)
        for n in ROWS:
            x = rng.standard_normal((n, shape[1])).astype(np.float32)
            y = quantized_linear(x, w)
            ref = x.astype(np.float64) @ dense.T
            assert y.shape == (n, shape[0]) and y.dtype == np.float32
            scale = np.abs(x).astype(np.float64) @ np.abs(dense).T  # float32 round-off scales with |x||W|
            assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-7), (shape, n)
            yb = quantized_linear(x.reshape(1, n, shape[1]), w, bias)  # batch dims and a bias
            np.testing.assert_allclose(yb[0], y + bias, rtol=1e-6, atol=1e-6)


def test_float32_products_of_a_few_rows_take_the_compiled_kernel(monkeypatch):
    """A few float32 rows (decoding) times a C-contiguous float32 weight: F.linear runs the
    compiled matrix-vector kernel, with NumPy's numbers to float32 round-off, infinities and
    NaNs where NumPy has them; more rows, float64, a weight's transposed view, or the
    kernels turned off: BLAS, as before."""
    if not fused_available():
        pytest.skip("numba (the fast extra) is not installed")
    from attnlab import _quant_kernels
    from attnlab.nn import functional as F
    from attnlab.quant import float32_matvec

    ran = []
    real = _quant_kernels.f32_matvec
    monkeypatch.setattr(_quant_kernels, "f32_matvec", lambda *a: (ran.append(a[1].shape), real(*a))[1])
    rng = np.random.default_rng(3)
    for R, K in [(1, 1), (7, 17), (100, 64), (960, 576)]:
        w = rng.standard_normal((R, K)).astype(np.float32)
        bias = rng.standard_normal(R).astype(np.float32)
        for n in ROWS:
            x = rng.standard_normal((n, K)).astype(np.float32)
            ran.clear()
            y = F.linear(x.reshape(1, n, K), w, bias)[0]
            assert ran == ([(n, K)] if n <= MATVEC_MAX_ROWS else []), (R, K, n)
            ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
            scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64) + np.abs(bias)
            assert y.dtype == np.float32 and np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-7), (R, K, n)
    w = rng.standard_normal((5, 32)).astype(np.float32)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    x[0, 3], x[1, 4] = np.inf, np.nan
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(float32_matvec(x, w), x @ w.T)  # inf, -inf and NaN alike
    assert float32_matvec(x.astype(np.float64), w) is None
    assert float32_matvec(x, np.asfortranarray(w)) is None
    assert float32_matvec(np.ones((MATVEC_MAX_ROWS + 1, 32), np.float32), w) is None
    with tuned(fused=False):
        assert float32_matvec(x, w) is None


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_a_prompt_product_runs_its_chunks_on_the_pool(kind, compiled, monkeypatch):
    """Past MATVEC_MAX_ROWS rows, the weight is dequantized and multiplied by chunks of rows
    on attnlab's pool (every chunk once, two threads here), giving the dense product."""
    import attnlab.quant as quant

    monkeypatch.setattr(quant, "CHUNK_ROWS", 16)
    monkeypatch.setattr(quant, "get_num_threads", lambda: 2)
    calls = []
    real = quant.run_units

    def spy(units, run_unit, threads, **kw):
        calls.append((list(units), threads))
        return real(units, run_unit, threads, **kw)

    monkeypatch.setattr(quant, "run_units", spy)
    rng = np.random.default_rng(5)
    w = QuantizedTensor.from_bytes(random_blocks(rng, kind, (100, 64)), kind, (100, 64))
    x = rng.standard_normal((MATVEC_MAX_ROWS + 3, 64)).astype(np.float32)
    y = quantized_linear(x, w)
    assert calls == [(list(range(0, 100, 16)), 2)]
    ref = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w.dequantize()).astype(np.float64).T
    assert np.all(np.abs(y - ref) <= 1e-5 * scale + 1e-7)


def test_the_kernel_and_the_fallback_agree():
    if not fused_available():
        pytest.skip("numba (the fast extra) is not installed")
    rng = np.random.default_rng(3)
    w = QuantizedTensor.from_bytes(random_blocks(rng, "Q4_1", (64, 128)), "Q4_1", (64, 128))
    x = rng.standard_normal((1, 128)).astype(np.float32)
    with tuned(fused=True):
        a = quantized_linear(x, w)
    with tuned(fused=False):
        b = quantized_linear(x, w)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(a, np.zeros_like(a))


def test_quantize_round_trips_within_a_step():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    blocks = w.reshape(8, 2, 32)
    amax, ptp = np.abs(blocks).max(axis=2), np.ptp(blocks, axis=2)
    # half a step; Q4_0 maps the largest magnitude to -8, so the other end may clip by a whole step
    for kind, bound in (("Q8_0", 0.5 * amax / 127), ("Q4_0", amax / 8), ("Q4_1", 0.5 * ptp / 15)):
        err = np.abs(QuantizedTensor.quantize(w, kind).dequantize() - w).reshape(8, 2, 32).max(axis=2)
        assert np.all(err <= bound * 1.01 + 1e-3), kind


def test_nbytes_counts_codes_scales_and_mins():
    raw = random_blocks(np.random.default_rng(5), "Q4_1", (4, 64))
    w = QuantizedTensor.from_bytes(raw, "Q4_1", (4, 64))
    assert w.nbytes == 4 * 32 + 2 * (4 * 2 * 4)  # nibbles + float32 scales and mins
    assert QuantizedTensor.from_bytes(random_blocks(np.random.default_rng(5), "Q8_0", (4, 64)), "Q8_0",
                                      (4, 64)).nbytes == 4 * 64 + 4 * 2 * 4


# ---- layouts that do not fit are refused, never multiplied -------------------------------
def test_a_row_length_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_up\.weight \(Q4_1, shape \(4, 40\), 80 bytes\).*"
                                         r"row length 40 is not a multiple of the block size 32"):
        QuantizedTensor.from_bytes(bytes(80), "Q4_1", (4, 40), name="blk.0.ffn_up.weight")


def test_a_byte_count_that_does_not_fit_the_shape_is_refused():
    with pytest.raises(ValueError, match=r"tensor w \(Q8_0, shape \(3, 64\)\): needs 3 rows x 2 blocks x 34 bytes "
                                         r"= 204 bytes, got 238"):
        QuantizedTensor.from_bytes(bytes(238), "Q8_0", (3, 64), name="w")


def test_a_truncated_buffer_is_refused():
    raw = random_blocks(np.random.default_rng(6), "Q4_0", (4, 64))
    with pytest.raises(ValueError, match=r"tensor t \(Q4_0, shape \(4, 64\)\): needs 4 rows x 2 blocks x 18 bytes "
                                         r"= 144 bytes, got 143"):
        QuantizedTensor.from_bytes(raw[:-1], "Q4_0", (4, 64), name="t")


def test_an_unsupported_type_or_a_non_matrix_is_refused():
    with pytest.raises(ValueError, match=r"tensor t: quantization type 'Q5_K' cannot be kept quantized; "
                                         r"supported: Q8_0, Q4_0, Q4_1"):
        QuantizedTensor.from_bytes(bytes(176), "Q5_K", (1, 256), name="t")
    with pytest.raises(ValueError, match=r"tensor t \(Q8_0, shape \(64,\), 68 bytes\): a quantized weight must be 2-D"):
        QuantizedTensor.from_bytes(bytes(68), "Q8_0", (64,), name="t")


def test_an_input_of_the_wrong_width_or_dtype_is_refused():
    w = QuantizedTensor.quantize(np.ones((4, 32), dtype=np.float32), "Q8_0")
    with pytest.raises(ValueError, match=r"x.*\(2, 31\).*\(\.\.\., 32\)"):
        quantized_linear(np.ones((2, 31), dtype=np.float32), w)
    with pytest.raises(TypeError, match="float64"):
        quantized_linear(np.ones((2, 32)), w)


def test_a_quantized_weight_is_not_silently_an_array():
    w = QuantizedTensor.quantize(np.ones((4, 32), dtype=np.float32), "Q8_0", name="blk.0.attn_q.weight")
    with pytest.raises(TypeError, match=r"QuantizedTensor\(Q8_0, shape=\(4, 32\).*blk\.0\.attn_q\.weight.*dequantize"):
        np.asarray(w)


def test_stacking_keeps_one_type_quantized():
    a = QuantizedTensor.quantize(np.ones((2, 32), dtype=np.float32), "Q4_1")
    b = QuantizedTensor.quantize(np.full((3, 32), 2.0, dtype=np.float32), "Q4_1")
    s = stack_rows([a, b])
    assert isinstance(s, QuantizedTensor) and s.shape == (5, 32)
    np.testing.assert_array_equal(s.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    mixed = stack_rows([a, QuantizedTensor.quantize(np.ones((1, 32), dtype=np.float32), "Q8_0")])
    assert isinstance(mixed, np.ndarray) and mixed.shape == (3, 32)


def test_no_backward_through_a_quantized_weight():
    from attnlab.nn import Linear

    layer = Linear(32, 4, rng=np.random.default_rng(0))
    layer.weight.data = QuantizedTensor.quantize(layer.weight.data, "Q8_0")
    y = layer(np.ones((2, 32), dtype=np.float32))
    assert y.shape == (2, 4)
    with pytest.raises(TypeError, match=r"no backward pass through a quantized weight \(Q8_0 \(4, 32\)\)"):
        layer.backward(np.ones_like(y))


# ---- models -------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_tiny_gguf_model_loaded_quantized_equals_its_float32_loading(tmp_path, qtype):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from attnlab.models.llama import Llama
    from gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=qtype)
    ref = Llama.from_pretrained(path)
    model = Llama.from_pretrained(path, quantized=True)
    block = model.layers[0]
    assert isinstance(block.attn.in_proj_weight.data, QuantizedTensor)  # q/k/v stacked, q/k rows unpermuted
    assert isinstance(block.mlp.down_proj.weight.data, QuantizedTensor)
    assert isinstance(model.tok_emb.weight.data, QuantizedTensor)  # the tied unembedding too
    np.testing.assert_array_equal(block.attn.in_proj_weight.data.dequantize(), ref.layers[0].attn.in_proj_weight.data)
    ids = np.array([[5, 9, 77, 3, 120, 8, 40, 41, 2, 60, 61, 62]])
    np.testing.assert_allclose(model(ids), ref(ids), atol=1e-5)  # prefill: dequantized chunks + BLAS
    np.testing.assert_array_equal(model.generate(ids, 6), ref.generate(ids, 6))  # decode: the kernels
    np.testing.assert_array_equal(model.W_U, ref.W_U)


def test_quantized_needs_a_gguf_file_and_float32(tmp_path):
    from attnlab.models.llama import Llama

    with pytest.raises(ValueError, match="quantized=True needs a .gguf file"):
        Llama.from_pretrained(tmp_path, quantized=True)
    with pytest.raises(ValueError, match="quantized=True computes in float32"):
        Llama.from_pretrained(tmp_path / "x.gguf", quantized=True, dtype=np.float64)


PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.", "What is the boiling point of water?", "Translate 'thank you' into Spanish.",
    "What does a bee make?",
]


@pytest.fixture(scope="module")
def smollm2_quantized(smollm2_gguf):
    from attnlab.models.llama import Llama

    return Llama.from_pretrained(smollm2_gguf.path, quantized=True)


@pytest.fixture
def one_thread():
    """One thread for numba's pool and BLAS: on a busy shared machine a two-thread barrier
    per product can wait a whole time slice (the numbers do not depend on it)."""
    from threadpoolctl import threadpool_limits

    import attnlab
    from attnlab import _threads

    before = _threads._num_threads  # None (all CPUs) or what a caller set
    attnlab.set_num_threads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        attnlab.set_num_threads(before)


def test_smollm2_quantized_logits_match_float32(smollm2_quantized, smollm2_model, one_thread):
    q, f = smollm2_quantized, smollm2_model
    assert isinstance(q.layers[0].mlp.up_proj.weight.data, QuantizedTensor)
    assert q.layers[0].mlp.up_proj.weight.data.kind == "Q4_1" and q.tok_emb.weight.data.kind == "Q8_0"
    for prompt in PROMPTS[:3]:
        ids = q.encode(q.chat_prompt(prompt))[0][None]
        cq, cf = q.new_cache(), f.new_cache()
        lq, lf = q(ids, cache=cq), f(ids, cache=cf)  # prefill
        assert np.abs(lq - lf).max() < 1e-2
        nxt = lf[:, -1:].argmax(-1)
        dq, df = q(nxt, cache=cq), f(nxt, cache=cf)  # one decode step: the matrix-vector kernels
        assert np.abs(dq - df).max() < 1e-2


def test_smollm2_quantized_greedy_answers_match_float32(smollm2_quantized, smollm2_model, one_thread):
    q, f = smollm2_quantized, smollm2_model
    same = 0
    for part in (PROMPTS[:5], PROMPTS[5:]):  # 5 rows a step: the matrix-vector kernels
        seqs = [f.encode(f.chat_prompt(p))[0] for p in part]
        T = max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), T), dtype=np.int64)
        mask = np.zeros((len(seqs), T), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
        a = q.generate(ids, 12, attention_mask=mask)
        b = f.generate(ids, 12, attention_mask=mask)
        same += int(np.sum(np.all(a == b, axis=1)))
    print(f"quantized greedy answers equal to float32: {same} of {len(PROMPTS)}")
    assert same >= 9, f"{same} of {len(PROMPTS)} answers equal"


def test_smollm2_quantized_answers_with_a_float16_cache(smollm2_quantized, one_thread):
    """A float16 cache (the compiled step reading and writing float16) keeps the quantized
    model's greedy answers and moves its logits by float16's rounding only."""
    q = smollm2_quantized
    seqs = [q.encode(q.chat_prompt(p))[0] for p in PROMPTS[:5]]
    T = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), T), dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
    a = q.generate(ids, 12, attention_mask=mask, cache_dtype="float16")
    b = q.generate(ids, 12, attention_mask=mask)
    same = int(np.sum(np.all(a == b, axis=1)))
    assert same >= 4, f"{same} of 5 answers equal"
    c16, c32 = q.new_cache(dtype="float16"), q.new_cache()
    one = ids[:1, T - len(seqs[0]):]
    q(one, cache=c16)
    l32 = q(one, cache=c32)
    nxt = l32[:, -1:].argmax(-1)
    d16, d32 = q(nxt, cache=c16), q(nxt, cache=c32)
    err = float(np.abs(d16 - d32).max() / np.abs(d32).max())
    print(f"float16 cache: {same} of 5 answers equal; one step's logits within {err:.2e} of the largest")
    assert c16[0]._key.dtype == np.float16 and 1e-6 < err < 2e-3, err


def test_cli_generate_quantized(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from attnlab.cli import main
    from gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1")
    args = ["generate", "--checkpoint", str(path), "--raw", "hello", "--max-new-tokens", "4"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--quantized"]) == 0
    quant = capsys.readouterr().out
    assert "quantized weights" in quant
    generated = [[line for line in out.splitlines() if line.startswith("generated")] for out in (plain, quant)]
    assert len(generated[0]) == 1 and generated[0] == generated[1]  # the same greedy tokens
    assert main([*args, "--quantized", "--cache-dtype", "float16"]) == 0
    half = capsys.readouterr().out
    assert "with a float16 key/value cache, quantized weights" in half
    assert [line for line in half.splitlines() if line.startswith("generated")] == generated[0]
    assert main([*args, "--quantized", "--cache-dtype", "int8"]) == 0
    codes = capsys.readouterr().out
    assert "with an int8 key/value cache, quantized weights" in codes
    assert [line for line in codes.splitlines() if line.startswith("generated")] == generated[0]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--cache-dtype", "int4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and "argument --cache-dtype: invalid choice: 'int4'" in err
    (tmp_path / "folder").mkdir()
    assert main(["generate", "--checkpoint", str(tmp_path / "folder"), "--quantized", "hi"]) == 2
    assert "--quantized needs a .gguf file" in capsys.readouterr().err


def test_without_the_compiled_kernels_a_quantized_load_is_float32_with_one_warning(tmp_path, monkeypatch):
    """Quantized decoding without numba would dequantize every weight at every step (slower
    than float32): the loader dequantizes once instead, and says so once."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from attnlab import quant
    from attnlab.models.llama import Llama
    from gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1")
    ref = Llama.from_pretrained(path)
    monkeypatch.setattr(quant, "_FALLBACK_WARNED", [])
    with tuned(fused=False):  # as without numba (or ATTNLAB_NO_NUMBA=1)
        with pytest.warns(quant.QuantizedFallbackWarning, match=r"to float32 .*pip install 'attnlab\[fast\]'"):
            model = Llama.from_pretrained(path, quantized=True)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = Llama.from_pretrained(path, quantized=True)  # once per process
    for m in (model, again):
        assert not any(isinstance(p.data, QuantizedTensor) for p in m.parameters())
        np.testing.assert_array_equal(m.layers[0].attn.in_proj_weight.data, ref.layers[0].attn.in_proj_weight.data)
    ids = np.array([[5, 9, 77, 3, 120, 8]])
    np.testing.assert_array_equal(model.generate(ids, 4), ref.generate(ids, 4))


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_state_dict_of_a_quantized_model_round_trips_as_copies(activations):
    from attnlab.models import Llama, LlamaConfig
    from attnlab.quant import quantize_activations

    cfg = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = Llama(cfg, rng=np.random.default_rng(5))
    for i, (name, p) in enumerate(model.named_parameters()):
        if name.startswith("blocks.") and p.data.ndim == 2:
            p.data = QuantizedTensor.quantize(p.data, ("Q8_0", "Q4_0", "Q4_1")[i % 3], name=name)
    if activations == "int8":
        quantize_activations(model)
    state = model.state_dict()
    w = model.layers[0].attn.in_proj_weight.data
    got = state["blocks.0.attn.in_proj_weight"]
    assert isinstance(got, QuantizedTensor) and (got.kind, got.activations) == (w.kind, activations)
    assert got.codes is not w.codes and not np.shares_memory(got.codes, w.codes)
    got.codes[...] = 0  # a copy: the model's weight is untouched
    assert w.codes.any()
    state = model.state_dict()
    other = Llama(cfg, rng=np.random.default_rng(6))
    other.load_state_dict(state)
    ids = np.array([[1, 5, 9, 2, 7]])
    assert np.array_equal(other(ids), model(ids))
