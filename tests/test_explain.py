"""attnlab.explain: models as callables, one layer numbering, the JSON document, the report's
starting view."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnlab.explain import MODELS, Explanation, decode_array, explain, round_significant
from attnlab.viz.html_report import render_html


def test_models_are_plain_callables():
    assert set(MODELS) == {"random", "minilm", "checkpoint", "gpt2", "smollm2"}
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
    assert d["format"] == "attnlab-explanation" and d["version"] == 5
    assert (d["model_name"], d["layer"], d["head"], d["layers"], d["heads"]) == ("random", 1, 1, 1, 2)
    assert d["attentions"]["shape"] == [1, 2, 4, 4] and d["unknown_tokens"] == 0
    # weights to 4 decimals (what the views show), vectors to 4 significant digits
    np.testing.assert_allclose(decode_array(d["attentions"]), e.attentions, rtol=0, atol=0.5e-4)
    np.testing.assert_allclose(decode_array(d["static"]), e.static, rtol=5e-4, atol=0)
    np.testing.assert_allclose(decode_array(d["contextual"]), e.contextual, rtol=5e-4, atol=0)
    assert d["trace"] is None  # the steps only when asked


def test_to_dict_steps_store_each_matrix_once():
    e = explain("Hello, world!", dim=8, heads=2)
    d = json.loads(json.dumps(e.to_dict(steps=True), allow_nan=False))
    steps = d["trace"]["steps"]
    weights = [s for s in steps if s["name"] == "weights"]
    assert [s["same_as"] for s in weights] == [["attentions", 0, 0], ["attentions", 0, 1]]
    assert all("values" not in s for s in weights)
    x = next(s for s in steps if s["name"] == "X")
    np.testing.assert_allclose(decode_array(x), e.trace.get("X"), rtol=5e-4)


def _paragraph(n_words: int, seed: int = 0) -> str:
    words = ("the river bank was quiet when the old fisherman walked along the water and watched "
             "birds fly over hills while children played near houses of stone and wood").split()
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(words, n_words))


def test_json_is_sized_to_its_content():
    small = json.dumps(explain("The cat sat").to_dict(), separators=(",", ":"))
    assert len(small.encode()) < 100_000  # was 1.5 MB (the weight matrices of every step)
    e = explain(_paragraph(345), dim=128, heads=4)  # 345 tokens, 4 heads
    big = json.dumps(e.to_dict(), separators=(",", ":"))
    assert len(big.encode()) < 10_000_000
    np.testing.assert_allclose(decode_array(json.loads(big)["attentions"]), e.attentions, atol=0.5e-4, rtol=0)


def test_round_significant():
    x = np.array([1.23456e-7, -98765.4321, 0.5, 0.0, -np.inf, 3.14159265])
    np.testing.assert_array_equal(round_significant(x), [1.235e-7, -98770.0, 0.5, 0.0, -np.inf, 3.142])
    assert json.dumps(round_significant(np.array([0.1234567])).tolist()) == "[0.1235]"


def test_lone_surrogates_become_replacement_characters_in_the_json():
    e = explain("caf\udce9 au lait", dim=8, heads=2)  # the byte \xe9 read in a UTF-8 locale
    doc = json.dumps(e.to_dict(), ensure_ascii=False)
    doc.encode("utf-8")  # would raise UnicodeEncodeError on a lone surrogate
    assert json.loads(doc)["text"] == "caf\ufffd au lait"


def test_unknown_tokens_are_counted():
    from attnlab.text import Vocabulary

    vocab = Vocabulary.from_texts(["the cat sat"])
    with pytest.warns(UserWarning, match="4 of 6 tokens are not in the vocabulary"):
        e = explain("the dog sat on a mat", vocab=vocab, dim=8, heads=2)
    assert e.unknown == 4 and e.to_dict()["unknown_tokens"] == 4
    assert any(n.startswith("4 of 6 tokens became <unk>") for n in e.notes)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match=r"model must be one of \['checkpoint', 'gpt2', 'minilm', 'random', "
                                         r"'smollm2'\], got 'gpt'"):
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
        assert "attention weights, layer 6 (of 1-6), head 2 (of 0-11)" in out
        assert "step by step (layer 6, head 2 (of 0-11))" in out and "weights  (7, 7)  head 2" in out
    task = RecallTask()
    cfg = TinyTransformerConfig(vocab_size=len(task.vocab), context_length=task.seq_len, d_model=16,
                                n_heads=2, n_layers=2, d_ff=32)
    path = tmp_path / "c.npz"
    save_checkpoint(path, TinyTransformer(cfg, rng=np.random.default_rng(0)), task)
    assert main(["explain", "k1 v5 k2 v9 k1", "--checkpoint", str(path), "--steps", "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention weights, layer 1 (of 1-2), head 0 (of 0-1)" in out
    assert "step by step (layer 1, head 0 (of 0-1))" in out


def _minilm_available() -> bool:
    try:
        from attnlab.models.bert import minilm_available
    except ImportError:
        return False
    return minilm_available()


@pytest.mark.skipif(not _minilm_available(), reason="the pretrained MiniLM package is not installed")
def test_minilm_json_and_report_are_sized_to_their_content():
    from attnlab.viz import render_html

    small = explain("The cat sat", model="minilm")
    assert len(json.dumps(small.to_dict(), separators=(",", ":")).encode()) < 100_000  # was 13.4 MB
    e = explain(_paragraph(345), model="minilm")  # truncated to 256 tokens
    assert e.attentions.shape == (6, 12, 256, 256)
    assert len(json.dumps(e.to_dict(), separators=(",", ":")).encode()) < 10_000_000  # was 190 MB
    assert len(render_html(e).encode()) < 5_000_000  # was 20.9 MB


@pytest.mark.skipif(not _minilm_available(), reason="the pretrained MiniLM package is not installed")
def test_minilm_counts_unknown_tokens():
    e = explain("我今天在银行旁边的河边散步，风景很美。", model="minilm")
    n = sum(t == "[UNK]" for t in e.tokens)
    assert n > 5 and e.unknown == n and e.to_dict()["unknown_tokens"] == n
    assert any(note.startswith(f"{n} of {len(e.tokens)} tokens became [UNK]") for note in e.notes)
    assert f"{len(e.tokens)} tokens ({n} of them unknown to the model)" in render_html(e)
