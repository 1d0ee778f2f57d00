"""attnlab.explain: models as callables, one layer numbering, the JSON document, the report's
starting view."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnlab.explain import MODELS, Explanation, explain
from attnlab.viz.html_report import render_html


def test_models_are_plain_callables():
    assert set(MODELS) == {"random", "minilm", "checkpoint", "gpt2"}
    assert all(callable(f) for f in MODELS.values())


def test_layer_numbering_and_defaults():
    e = explain("the cat sat", dim=8, heads=2)
    assert (e.layer, e.head, e.n_layers, e.n_heads) == (1, 0, 1, 2)
    e = explain("the cat sat", dim=8, heads=2, layer=-1, head=-1)
    assert (e.layer, e.head) == (1, 1)
    np.testing.assert_array_equal(e.weights(), e.attentions[0, 1])
    with pytest.raises(ValueError, match=r"^layer 0 is the embeddings, which have no attention"):
        explain("the cat sat", dim=8, heads=2, layer=0)
    with pytest.raises(ValueError, match=r"^layer must be in 1\.\.1 \(or -1\.\.-1\) .* got 2$"):
        explain("the cat sat", dim=8, heads=2, layer=2)
    with pytest.raises(ValueError, match=r"^head must be in 0\.\.1 \(or -2\.\.-1\), got 2$"):
        explain("the cat sat", dim=8, heads=2, head=2)


def test_trace_is_the_layers_own_weights():
    e = explain("the cat sat on the mat", dim=18, heads=3, seed=4)
    for h in range(3):
        np.testing.assert_array_equal(e.trace.get("weights", h), e.attentions[0, h])


def test_trace_is_skipped_for_long_texts_unless_asked():
    from attnlab.explain.backends import TRACE_MAX_TOKENS

    text = " ".join(f"w{i}" for i in range(TRACE_MAX_TOKENS + 1))
    e = explain(text, dim=4, heads=1)
    assert e.trace is None and any("no step-by-step trace" in n for n in e.notes)
    assert explain(text, dim=4, heads=1, trace=True).trace is not None
    assert explain("a b", dim=4, heads=1, trace=False).trace is None


def test_to_dict_is_the_json_document():
    e = explain("Hello, world!", dim=8, heads=2, head=1)
    d = json.loads(json.dumps(e.to_dict(), allow_nan=False))
    assert d["format"] == "attnlab-explanation" and d["version"] == 2
    assert (d["model_name"], d["layer"], d["head"], d["layers"], d["heads"]) == ("random", 1, 1, 1, 2)
    assert d["attentions"]["shape"] == [1, 2, 4, 4]
    np.testing.assert_allclose(np.array(d["attentions"]["values"]), e.attentions, rtol=1e-7)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match=r"model must be one of \['checkpoint', 'gpt2', 'minilm', 'random'\], "
                                         r"got 'gpt'"):
        explain("a", model="gpt")


def _payload(html: str) -> dict:
    m = re.search(r'<script type="application/json" class="al-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_report_opens_on_the_explained_layer_and_head():
    rng = np.random.default_rng(0)
    att = rng.dirichlet(np.ones(3), size=(4, 2, 3))  # (layers, heads, T, T)
    e = Explanation("a b c", ["a", "b", "c"], "toy: 4 layers", att, rng.standard_normal((3, 5)),
                    rng.standard_normal((3, 5)), layer=3, head=1)
    data = _payload(render_html(e))
    assert (data["layer"], data["head"]) == (2, 1)  # layer 3 is index 2 of the maps
    data = _payload(render_html(Explanation("a b c", ["a", "b", "c"], "toy", att, np.eye(3), np.eye(3))))
    assert (data["layer"], data["head"]) == (3, 0)  # default: the last layer


def test_minilm_steps_are_the_layers_own_weights():
    from attnlab.models.bert import minilm_available

    if not minilm_available():
        pytest.skip("the pretrained MiniLM package is not installed")
    e = explain("The bank of the river", model="minilm", layer=4, head=7)
    assert (e.layer, e.head, e.trace.layer) == (4, 7, 4)
    for h in range(12):
        np.testing.assert_array_equal(e.trace.get("weights", h), e.attentions[3, h])
    assert e.trace.tokens == e.tokens


def test_cli_steps_with_minilm_and_a_checkpoint(tmp_path, capsys):
    from attnlab.cli import main
    from attnlab.models.bert import minilm_available
    from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
    from attnlab.train.checkpoint import save_checkpoint
    from attnlab.train.tasks import RecallTask

    if minilm_available():
        assert main(["explain", "The bank of the river", "--steps", "--layer", "6", "--head", "2"]) == 0
        out = capsys.readouterr().out
        assert "attention weights, layer 6 of 6, head 2 of 12" in out
        assert "step by step (layer 6, head 2 of 12)" in out and "weights  (7, 7)  head 2" in out
    task = RecallTask()
    cfg = TinyTransformerConfig(vocab_size=len(task.vocab), context_length=task.seq_len, d_model=16,
                                n_heads=2, n_layers=2, d_ff=32)
    path = tmp_path / "c.npz"
    save_checkpoint(path, TinyTransformer(cfg, rng=np.random.default_rng(0)), task)
    assert main(["explain", "k1 v5 k2 v9 k1", "--checkpoint", str(path), "--steps", "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention weights, layer 1 of 2, head 0 of 2" in out and "step by step (layer 1, head 0 of 2)" in out
