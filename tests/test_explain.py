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
    assert set(MODELS) == {"random", "minilm", "checkpoint"}
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
    with pytest.raises(ValueError, match=r"model must be one of \['checkpoint', 'minilm', 'random'\], got 'gpt'"):
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
