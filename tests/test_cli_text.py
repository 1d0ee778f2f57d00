"""The installed ``attnlab`` console script: demo and explain, run in a subprocess."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKENS = ["the", "cat", "sat", "on", "the", "mat"]


def _script() -> str:
    exe = Path(sys.executable).parent / "attnlab"
    if exe.exists():
        return str(exe)
    found = shutil.which("attnlab")
    if found is None:
        pytest.fail("the attnlab console script is not installed (pip install -e .)")
    return found


def run(*args, cwd=None, check_rc=None):
    env = {**os.environ, "NO_COLOR": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([_script(), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("cmd", [[], ["demo"], ["explain"]])
def test_help(cmd):
    proc = run(*cmd, "--help", check_rc=0)
    assert "usage: attnlab" in proc.stdout


def test_python_m_attnlab():
    proc = subprocess.run([sys.executable, "-m", "attnlab", "explain", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--steps" in proc.stdout


def test_demo_prints_tables_and_writes_pictures(tmp_path):
    out = tmp_path / "pics"
    proc = run("demo", "--model", "random", "--out", str(out), check_rc=0)
    text = proc.stdout
    assert "random (teaching model): embed_dim 128, 4 heads, seed 0" in text
    assert "token vectors (static, layer 0)" in text and "(6, 128)" in text and "(1, 4, 6, 6)" in text
    assert "attention weights, layer 1 (of 1-1), head 0 (of 0-3)" in text
    header = next(line for line in text.splitlines() if line.split() == TOKENS)
    assert header  # the weights table is labelled by the tokens
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["cat"]]
    assert rows and len(rows[0]) == 7 and abs(sum(map(float, rows[0][1:])) - 1) < 0.05
    assert "\x1b[" not in text  # no colour when not on a TTY
    for name in ("heatmap.png", "heads.png", "embeddings.png"):
        w, h = png_size(out / name)
        assert 500 <= w <= 4000 and 400 <= h <= 3000, (name, w, h)
        assert str(out / name) in text
    assert sorted(p.name for p in out.iterdir()) == ["embeddings.png", "heads.png", "heatmap.png"]


def test_demo_default_out_dir_and_model_named(tmp_path):
    proc = run("demo", cwd=tmp_path, check_rc=0)
    assert (tmp_path / "attnlab-out" / "heatmap.png").exists()
    assert (tmp_path / "attnlab-out" / "embeddings.png").exists()
    assert "--model " in proc.stdout  # says which model was used


def test_demo_seed_changes_weights(tmp_path):
    a = run("demo", "--model", "random", "--seed", "1", "--out", str(tmp_path / "a"), check_rc=0)
    b = run("demo", "--model", "random", "--seed", "2", "--out", str(tmp_path / "b"), check_rc=0)
    marker = "attention weights, layer"
    assert a.stdout.split(marker)[1] != b.stdout.split(marker)[1]


def test_explain_steps_walk_through():
    proc = run("explain", "The cat sat on the mat", "--model", "random", "--dim", "16",
               "--heads", "2", "--steps", "--head", "1", check_rc=0)
    text = proc.stdout
    for step in ("X  (6, 16)", "W_q  (16, 8)  head 1", "Q  (6, 8)  head 1", "scores  (6, 6)",
                 "scaled_scores  (6, 6)", "weights  (6, 6)", "head_output  (6, 8)",
                 "concat  (6, 16)", "output  (6, 16)"):
        assert step in text, step
    assert "step by step (layer 1, head 1 (of 0-1))" in text
    assert "head 0" not in text.split("step by step")[1].replace("other heads", "")
    assert "1/sqrt(8)" in text


def test_explain_json_to_stdout_and_file(tmp_path):
    proc = run("explain", "Hello, world!", "--model", "random", "--dim", "8", "--heads", "2",
               "--format", "json", check_rc=0)
    doc = json.loads(proc.stdout)
    assert doc["format"] == "attnlab-explanation" and doc["model_name"] == "random"
    assert doc["tokens"] == ["hello", ",", "world", "!"]
    assert doc["attentions"]["shape"] == [1, 2, 4, 4]
    assert doc["static"]["shape"] == [4, 8]
    assert doc["trace"] is None  # the steps only with --steps
    proc = run("explain", "Hello, world!", "--model", "random", "--dim", "8", "--heads", "2",
               "--format", "json", "--steps", check_rc=0)
    assert [s["name"] for s in json.loads(proc.stdout)["trace"]["steps"]][:2] == ["X", "W_q"]
    out = tmp_path / "o"
    proc = run("explain", "a b", "--model", "random", "--dim", "8", "--heads", "2",
               "--format", "json", "--out", str(out), check_rc=0)
    assert json.loads((out / "explanation.json").read_text()) == json.loads(proc.stdout)
    assert "wrote" in proc.stderr and "wrote" not in proc.stdout
    assert png_size(out / "heatmap.png")[0] > 300


def test_explain_long_text_is_truncated_in_print():
    text = " ".join(f"w{i}" for i in range(30))
    proc = run("explain", text, "--model", "random", "--dim", "8", "--heads", "2", check_rc=0)
    assert "showing the first 24 of 30 tokens" in proc.stdout
    assert f"text    {text!r}" in proc.stdout  # short enough: whole


def test_explain_very_long_text_is_shortened_on_the_text_line():
    text = " ".join(f"w{i % 50}" for i in range(1000))
    proc = run("explain", text, "--model", "random", "--dim", "8", "--heads", "2", check_rc=0)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("text "))
    assert len(line) < 160 and f"({len(text):,} characters, 1,000 words)" in line
    tokens = next(x for x in proc.stdout.splitlines() if x.startswith("tokens "))
    assert tokens.startswith("tokens  1000: w0 | w1") and tokens.endswith("\u2026 936 more")


def test_explain_fixed_vocabulary_warns_about_unknown_words(tmp_path):
    vocab = tmp_path / "v.json"
    vocab.write_text('{"format": "attnlab-vocabulary", "version": 1, "words": ["the", "cat"]}')
    proc = run("explain", "the dog", "--model", "random", "--vocab", str(vocab), "--dim", "8",
               "--heads", "2", check_rc=0)
    assert "'dog'" in proc.stderr and "<unk>" in proc.stderr
    proc = run("explain", "dogs bark", "--model", "random", "--vocab", str(vocab))
    assert_one_line_error(proc, "none of the words")


@pytest.mark.parametrize("args, fragment", [
    (["", "--model", "random"], "TEXT is empty"),
    (["   \t", "--model", "random"], "TEXT is empty"),
    (["the cat", "--model", "random", "--heads", "3"], "--heads 3 must divide --dim 128"),
    (["the cat", "--model", "random", "--dim", "0"], "--dim must be a positive integer"),
    (["the cat", "--model", "random", "--heads", "-2"], "--heads must be a positive integer"),
    (["the cat", "--model", "random", "--dim", str(10**9)], "GiB"),
    (["the cat", "--model", "random", "--dim", "10**9"], "invalid int value"),
    (["the cat", "--model", "random", "--layer", "2"], "--layer must be in 1..1 (or -1..-1)"),
    (["the cat", "--model", "random", "--layer", "0"], "--layer 0 is the embeddings, which have no attention"),
    (["the cat", "--model", "random", "--head", "4"], "--head must be in 0..3 (or -4..-1), got 4"),
    (["the cat", "--model", "random", "--seed", "-1"], "--seed"),
    (["the cat", "--model", "nope"], "invalid choice"),
    (["the cat", "--model", "checkpoint"], "--checkpoint"),
    (["the cat", "--model", "random", "--checkpoint", "x.npz"], "--model checkpoint"),
])
def test_explain_bad_input_one_line_exit_2(tmp_path, args, fragment):
    out = tmp_path / "out"
    proc = run("explain", *args, "--out", str(out))
    assert_one_line_error(proc, fragment)
    assert not out.exists() or not any(out.iterdir())  # nothing that looks like success


def test_unwritable_out(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "sub"):
        proc = run("explain", "the cat", "--model", "random", "--out", str(out))
        assert_one_line_error(proc, "cannot write to output folder")
    proc = run("demo", "--model", "random", "--out", str(blocker))
    assert_one_line_error(proc, "cannot write to output folder")


def test_missing_backend_or_checkpoint_is_one_line(tmp_path):
    proc = run("explain", "the cat", "--checkpoint", str(tmp_path / "missing.npz"))
    assert_one_line_error(proc)  # "model checkpoint is not available" or "file not found"


def test_html_report_or_one_line(tmp_path):
    target = tmp_path / "r.html"
    proc = run("explain", "the cat", "--model", "random", "--dim", "8", "--heads", "2",
               "--html", str(target))
    if proc.returncode == 0:  # the report module is installed
        assert target.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")
    else:
        assert_one_line_error(proc, "--html")
        assert not target.exists()


def test_make_demo(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    makefile = ROOT / "Makefile"
    if not makefile.exists() or "$(BIN)/attnlab demo" not in makefile.read_text():
        pytest.fail("the Makefile's demo target should run $(BIN)/attnlab demo")
    # Only run it where `make` would not reinstall (a venv made by `make install`).
    up_to_date = subprocess.run(["make", "-q", "-C", str(ROOT), ".venv/.installed"],
                                capture_output=True).returncode == 0
    if not up_to_date:
        pytest.skip("no .venv made by `make install` here; `make demo` would install first")
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "demo"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "attention weights" in proc.stdout
    assert png_size(ROOT / "attnlab-out" / "embeddings.png")[0] > 500
