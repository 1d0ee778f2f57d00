"""What a newcomer and a hostile user meet: odd numbers, files that disagree with
themselves, undecodable bytes, text in any script, long texts, standard input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.models.generate import next_token
from attnlab.models.gpt2 import GPT2, GPT2Config, parameter_shapes

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)


def write_gpt2(folder: Path, config: dict | None = None, *, seed: int = 0, **changes) -> Path:
    """A GPT-2 checkpoint folder written without torch: config.json (``changes`` applied
    after the weights are made) and model.safetensors in transformers' names and layout."""
    from attnlab.io import save_tensors
    from attnlab.io.names import gpt2_name_map, gpt2_transposed

    cfg = GPT2Config(**{**CFG, **(config or {})})
    model = GPT2(cfg, rng=np.random.default_rng(seed))
    state = model.state_dict()
    transposed = gpt2_transposed(cfg.n_layer)
    tensors = {src: np.ascontiguousarray(state[name].T if name in transposed else state[name])
               for name, (src,) in gpt2_name_map(cfg.n_layer).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", **cfg.to_dict(), **changes}))
    return folder


def _script() -> str:
    exe = Path(sys.executable).parent / "attnlab"
    return str(exe) if exe.exists() else "attnlab"


def run(*args, input: bytes | None = None, cwd=None) -> subprocess.CompletedProcess:
    """The console script in a C.UTF-8 locale, warnings shown as a user sees them; bytes out."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(LC_ALL="C.UTF-8", NO_COLOR="1")
    return subprocess.run([_script(), *args], input=input, capture_output=True, env=env, cwd=cwd, timeout=300)


def one_line(proc, *fragments) -> str:
    err = proc.stderr.decode("utf-8")
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err
    return err


# ---- the sampler ----------------------------------------------------------------------------
def test_a_tiny_temperature_samples_the_likeliest_token():
    logits = np.array([[0.1, 2.0, -1.0, 2.0 - 1e-12], [5.0, -np.inf, 4.0, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        for t in (1e-310, 5e-324, 1e-30):
            got = next_token(logits, temperature=t, rng=np.random.default_rng(0))
            assert got.tolist() == [1, 0], t


def test_the_sampler_never_draws_from_nan():
    for bad in ([[np.nan, 1.0]], [[np.inf, 1.0]], [[-np.inf, -np.inf]]):
        with pytest.raises(ValueError, match=r"cannot pick the next token from NaN or \+inf"):
            next_token(np.array(bad), temperature=1.0, rng=np.random.default_rng(0))


def test_gpt2_generate_at_a_tiny_temperature_is_greedy():
    model = GPT2(GPT2Config(**CFG), rng=np.random.default_rng(1))
    prompt = np.array([1, 2, 3])
    greedy = model.generate(prompt, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny = model.generate(prompt, 5, temperature=1e-310, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(tiny, greedy)


def test_cli_generate_at_a_tiny_temperature(tmp_path):
    folder = write_gpt2(tmp_path / "g")
    greedy = run("generate", "--checkpoint", str(folder), "1 2 3", "--max-new-tokens", "4")
    tiny = run("generate", "--checkpoint", str(folder), "1 2 3", "--max-new-tokens", "4", "--temperature", "1e-310")
    assert greedy.returncode == tiny.returncode == 0 and tiny.stderr == b"", tiny.stderr
    seq = [line for line in tiny.stdout.decode().splitlines() if line.startswith("generated")]
    assert len(seq) == 1 and seq == [line for line in greedy.stdout.decode().splitlines()
                                     if line.startswith("generated")]


# ---- GPT-2 folders whose config disagrees with the weights ------------------------------------
def test_parameter_shapes_are_the_models():
    cfg = GPT2Config(**{**CFG, "n_inner": 24})
    model = GPT2(cfg, rng=np.random.default_rng(0))
    assert parameter_shapes(cfg) == {n: p.shape for n, p in model.named_parameters()}


@pytest.mark.parametrize("change, message", [
    ({"n_layer": 1000}, "n_layer is 1000, but .* holds 2 layers"),
    ({"n_layer": 10**7}, "n_layer is 10,000,000, more than the 1,024 attnlab reads"),
    ({"n_positions": 10**6}, r"tensor 'wpe.weight' has shape \(16, 16\), but should be \(1000000, 16\)"),
    ({"n_positions": 10**9}, r"n_positions is 1,000,000,000, more than the 16,777,216 attnlab reads"),
    ({"n_layer": 1}, "n_layer is 1, but .* holds 2 layers"),
    ({"vocab_size": 10**6}, r"tensor 'wte.weight' has shape \(40, 16\)"),
    ({"n_inner": 10**6}, r"tensor 'h.0.mlp.c_fc.weight' has shape \(16, 64\)"),
    ({"n_inner": 2**40}, r"n_inner is 1,099,511,627,776, more than the 1,048,576 attnlab reads"),
])
def test_the_header_is_checked_before_anything_is_allocated(tmp_path, monkeypatch, change, message):
    from attnlab.io import CheckpointError

    folder = write_gpt2(tmp_path / "g", **change)

    def built(*args, **kwargs):
        raise AssertionError("the model was built before its shapes were checked against the file")

    monkeypatch.setattr(GPT2, "__init__", built)
    with pytest.raises(CheckpointError, match=message):
        GPT2.from_pretrained(folder)


def test_cli_refuses_the_disagreeing_folder_in_one_line(tmp_path):
    folder = write_gpt2(tmp_path / "g", n_layer=10**7)
    for cmd in (["generate", "--checkpoint", str(folder), "1 2 3"],
                ["explain", "--checkpoint", str(folder), "1 2 3", "--model", "gpt2"]):
        one_line(run(*cmd), "n_layer is 10,000,000, more than the 1,024 attnlab reads")


@pytest.mark.parametrize("argv", [
    ["generate", "--checkpoint", "{folder}", "1 2 3"],
    ["explain", "1 2 3", "--checkpoint", "{folder}"],
])
def test_out_of_memory_is_one_line_in_every_command(tmp_path, monkeypatch, capsys, argv):
    folder = write_gpt2(tmp_path / "g")

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(GPT2, "from_pretrained", no_memory)
    assert main([a.format(folder=folder) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not enough memory" in err, err


def test_out_of_memory_anywhere_is_one_line(monkeypatch, capsys):
    import attnlab.cli.similarity as similarity

    def no_memory(args):
        raise MemoryError

    monkeypatch.setattr(similarity, "run", no_memory)
    assert main(["similarity", "a bank", "the bank", "--word", "bank"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab similarity: error: not enough memory") and err.count("\n") == 1, err


def test_a_tokenizer_json_that_is_a_directory_is_reported(tmp_path, capsys):
    folder = write_gpt2(tmp_path / "g")
    (folder / "tokenizer.json").mkdir()
    with pytest.warns(UserWarning, match=r"tokenizer.json is not read: it is a directory, not a file"):
        model = GPT2.from_pretrained(folder)
    assert model.tokenizer is None
    proc = run("generate", "--checkpoint", str(folder), "1 2 3", "--max-new-tokens", "1")
    err = proc.stderr.decode()
    assert proc.returncode == 0 and err.count("\n") == 1 and err.startswith("attnlab: warning: "), err
    assert "is a directory" in err


# ---- interop refuses what the loader refuses ---------------------------------------------------
@pytest.mark.parametrize("setting", [{"tie_word_embeddings": False}, {"scale_attn_weights": False},
                                     {"scale_attn_by_inverse_layer_idx": True}, {"add_cross_attention": True}])
def test_from_torch_refuses_gpt2_settings_the_loader_refuses(tmp_path, setting):
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import from_torch
    from attnlab.io import CheckpointError

    (key, value), = setting.items()
    cfg = transformers.GPT2Config(**CFG, bos_token_id=0, eos_token_id=0, **setting)
    module = transformers.GPT2LMHeadModel(cfg).eval()
    with pytest.raises(ValueError, match=f"GPT2LMHeadModel: {key}={value} is not supported"):
        from_torch(module)
    folder = write_gpt2(tmp_path / "g", **setting)
    with pytest.raises(CheckpointError, match=f"{key}={value} is not supported"):
        GPT2.from_pretrained(folder)


# ---- undecodable bytes, any script ---------------------------------------------------------------
def test_bytes_that_are_not_utf8_become_replacement_characters(tmp_path):
    text = b"caf\xe9 au lait"  # Latin-1 in a UTF-8 locale: Python reads a lone surrogate
    out = tmp_path / "o"
    proc = run("explain", text, "--model", "random", "--out", str(out))
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert "caf\ufffd" in proc.stdout.decode("utf-8")  # strict: every byte is UTF-8
    assert sorted(p.name for p in out.iterdir()) == ["embeddings.png", "heads.png", "heatmap.png"]
    proc = run("explain", text, "--model", "random", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.decode("utf-8"))
    assert doc["text"] == "caf\ufffd au lait" and "\ufffd" in doc["tokens"]
    html = tmp_path / "r.html"
    assert run("explain", text, "--model", "random", "--html", str(html)).returncode == 0
    assert "caf\ufffd" in html.read_text(encoding="utf-8")


def test_text_from_stdin_and_from_a_file(tmp_path):
    proc = run("explain", "-", "--model", "random", "--format", "json", input=b"The cat sat\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == ["the", "cat", "sat"]
    path = tmp_path / "t.txt"
    path.write_bytes(b"A dog \xff barked")  # not UTF-8
    proc = run("explain", "--file", str(path), "--model", "random", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"] == "A dog \ufffd barked"
    one_line(run("explain", "words", "--file", str(path)), "either as TEXT or with --file")
    one_line(run("explain", "--file", str(tmp_path / "missing.txt")), "missing.txt is missing")
    one_line(run("explain", "--file", str(tmp_path)), "is a directory")
    one_line(run("explain"), "no text")


def test_similarity_refuses_a_word_with_a_space():
    one_line(run("similarity", "The bank closed.", "The bank closed early.", "--word", "bank closed"),
             "--word must be one word (no spaces), got 'bank closed'")


def test_help_has_no_restructured_text_markup():
    from attnlab.cli import COMMANDS

    for cmd in COMMANDS:
        proc = run(cmd, "--help")
        assert proc.returncode == 0 and b"``" not in proc.stdout, cmd


def test_bench_shares_without_torch_are_a_dash():
    from attnlab.cli.bench import _pct

    assert _pct(None, 100.0) == "-" and _pct(50.0, None) == "-" and _pct(50.0, 100.0) == "50%"


def test_bench_loads_sentence_transformers_without_a_progress_bar():
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from attnlab.benchmark import _quietly

    hf_logging.enable_progress_bar()
    assert _quietly(hf_logging.is_progress_bar_enabled) is False
    assert hf_logging.is_progress_bar_enabled()  # put back


def test_readme_examples_need_no_test_helpers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    examples = "\n".join(re.findall(r"```python\n(.*?)```", readme, re.S))
    assert "pytest" not in examples
    assert "follows once attnlab has it" not in readme


# ---- pictures: fonts, labels that fit ------------------------------------------------------------
def test_an_installed_font_draws_what_the_default_font_cannot():
    from matplotlib import font_manager

    from attnlab.viz.plots import _charmap, font_families

    text = "我今天在银行旁边的河边散步"
    font_manager.findSystemFonts()
    has_cjk = any(all(ord(c) in _charmap(path) for c in text) for path in font_manager.findSystemFonts())
    if not has_cjk:
        pytest.skip("no installed font has Chinese characters (make fonts installs fonts-noto-cjk)")
    families, missing = font_families([text])
    assert missing == [] and len(families) == 2 and families[0] == "DejaVu Sans"


def test_characters_no_font_has_are_said_once_in_one_line(tmp_path, monkeypatch):
    from matplotlib import font_manager

    from attnlab.viz import plots

    monkeypatch.setattr(plots, "_SAID", set())
    dejavu = [f for f in font_manager.fontManager.ttflist if f.name == "DejaVu Sans"]
    monkeypatch.setattr(font_manager.fontManager, "ttflist", dejavu)  # a machine with one font
    monkeypatch.setattr(font_manager, "findSystemFonts", lambda *a, **k: [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plots.plot_attention(np.full((3, 3), 1 / 3), ["我", "今", "天"], title="我今天")
        plots.save_figure(fig, tmp_path / "h.png")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert messages[0].startswith("the pictures cannot draw 3 character(s) of the labels (今 天 我)")


def test_cli_says_once_that_labels_cannot_be_drawn(tmp_path):
    # U+F0000 (a private-use character) is in no font: the one-line fallback, never
    # matplotlib's warnings with their source lines
    proc = run("explain", "a \U000f0000 b", "--model", "random", "--out", str(tmp_path / "o"))
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Glyph" not in err and "savefig" not in err, err
    assert err.count("\n") == 1 and "attnlab: warning: the pictures cannot draw 1 character(s)" in err, err


def test_long_heatmaps_label_what_fits():
    from attnlab.viz.plots import plot_attention, plot_heads

    T = 256
    tokens = [f"tok{i}" for i in range(T)]
    w = np.full((T, T), 1 / T)
    fig = plot_attention(w, tokens)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    step = int(labels[1][3:])
    assert 20 < len(labels) < T and labels == tokens[::step]
    assert "labelled" in ax.get_xlabel()
    _assert_no_overlap([t for t in ax.get_yticklabels()], fig)
    fig = plot_heads(np.full((4, T, T), 1 / T), tokens)
    assert all(len(a.get_xticklabels()) < T for a in fig.axes[:4])


def _assert_no_overlap(texts, fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # the final layout
    boxes = [Text.get_window_extent(t, renderer) for t in texts if t.get_text() and t.get_visible()]  # no leader
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap_w = min(a.x1, b.x1) - max(a.x0, b.x0)
            overlap_h = min(a.y1, b.y1) - max(a.y0, b.y0)
            assert overlap_w <= 0.5 or overlap_h <= 0.5, (a, b)


def test_embedding_labels_never_overprint_and_say_what_was_left_out():
    from attnlab.viz.plots import plot_embeddings

    rng = np.random.default_rng(0)
    T = 345
    tokens = [f"word{i}" for i in range(T)]
    fig = plot_embeddings(rng.standard_normal((T, 16)), rng.standard_normal((T, 16)), tokens)
    ax = fig.axes[0]
    labels = [t for a in fig.axes for t in a.texts if t.get_gid() == "token-label"]
    assert 0 < len(labels) < 2 * T
    for a in fig.axes:
        _assert_no_overlap([t for t in a.texts if t.get_gid() == "token-label"], fig)
    title = ax.get_legend().get_title().get_text()
    left_out = 2 * T - len(labels)
    assert title == f"{len(labels)} of {2 * T} point labels drawn; {left_out} left out where there was no room"


def test_every_command_reads_bytes_that_are_not_utf8(tmp_path):
    pytest.importorskip("tokenizers")
    from helpers import byte_bpe_tokenizer

    folder = write_gpt2(tmp_path / "g", {"vocab_size": 300})
    byte_bpe_tokenizer(folder / "tokenizer.json")
    proc = run("generate", "--checkpoint", str(folder), b"caf\xe9 au", "--max-new-tokens", "2")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    assert "prompt     caf\ufffd au" in proc.stdout.decode("utf-8")


def _minilm_available() -> bool:
    try:
        from attnlab.models.bert import minilm_available
    except ImportError:
        return False
    return minilm_available()


@pytest.mark.skipif(not _minilm_available(), reason="the pretrained MiniLM package is not installed")
def test_similarity_reads_bytes_that_are_not_utf8():
    proc = run("similarity", b"the bank caf\xe9", b"the bank", "--word", "bank")
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert "caf\ufffd" in proc.stdout.decode("utf-8")
