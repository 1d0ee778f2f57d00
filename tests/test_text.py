"""attnlab.text: tokenizer, vocabulary, one-hot, embeddings, positions, word2vec, pipeline."""

import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.explain import random_model as explain_random
from attnlab.text import (
    Embedding,
    Tokenizer,
    Vocabulary,
    one_hot,
    sinusoidal_positions,
    text_to_embeddings,
)
from attnlab.text.pipeline import estimate_bytes

SENTENCE = "The cat sat on the mat"


# ---- tokenizer ----------------------------------------------------------------------------
def test_tokenizer_words_punctuation_and_spans():
    text = "Hello, World! It's state-of-the-art."
    toks = Tokenizer().tokenize(text)
    assert [t.text for t in toks] == ["hello", ",", "world", "!", "it's", "state-of-the-art", "."]
    for t in toks:
        assert text[t.start : t.end].lower() == t.text


def test_tokenizer_keeps_case_when_asked():
    assert Tokenizer(lowercase=False)("The Cat") == ["The", "Cat"]


def test_tokenizer_blank_and_type():
    assert Tokenizer()("   \n\t ") == []
    with pytest.raises(TypeError, match="text must be a str"):
        Tokenizer()(b"bytes")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=60))
def test_tokenizer_spans_cover_every_non_space_character(text):
    toks = Tokenizer(lowercase=False).tokenize(text)
    covered = set()
    for t in toks:
        assert text[t.start : t.end] == t.text
        covered.update(range(t.start, t.end))
    assert all(c.isspace() for i, c in enumerate(text) if i not in covered)


# ---- vocabulary ---------------------------------------------------------------------------
def test_vocabulary_from_texts_specials_and_order():
    v = Vocabulary.from_texts([SENTENCE, "A dog sat."])
    assert v.words[:2] == ["<pad>", "<unk>"]
    assert v.words[2:] == ["the", "cat", "sat", "on", "mat", "a", "dog", "."]
    assert v.pad_id == 0 and v.unk_id == 1 and len(v) == 10
    assert "cat" in v and "cow" not in v


def test_vocabulary_min_count_and_max_size():
    v = Vocabulary.from_texts(["a a a b b c"], min_count=2)
    assert v.words[2:] == ["a", "b"]
    v = Vocabulary.from_texts(["c a a a b b"], max_size=1)
    assert v.words[2:] == ["a"]


def test_vocabulary_json_round_trip(tmp_path):
    v = Vocabulary.from_words(["the", "cat", "über", "<unk>", "cat"])
    path = tmp_path / "vocab.json"
    v.save(path)
    w = Vocabulary.load(path)
    assert w == v and w.words == ["<pad>", "<unk>", "the", "cat", "über"]
    assert json.loads(path.read_text("utf-8"))["format"] == "attnlab-vocabulary"


def test_vocabulary_load_rejects_other_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not an attnlab vocabulary"):
        Vocabulary.load(p)
    p.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        Vocabulary.load(p)


def test_unknown_word_maps_to_unk_with_a_warning_and_is_not_dropped():
    v = Vocabulary.from_words(["the", "cat"])
    with pytest.warns(UserWarning, match="'dog'"):
        ids = v.encode(["the", "dog", "cat"])
    assert ids.tolist() == [2, 1, 3]  # three tokens in, three ids out
    assert v.decode(ids) == ["the", "<unk>", "cat"]


def test_known_words_do_not_warn():
    v = Vocabulary.from_words(["the", "cat"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v.encode(["the", "cat"])


def test_decode_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Vocabulary.from_words(["a"]).decode([5])


# ---- one-hot, embedding, positions ----------------------------------------------------------
def test_one_hot_picks_table_rows():
    ids = np.array([[0, 3, 2]])
    oh = one_hot(ids, 5)
    assert oh.shape == (1, 3, 5) and (oh.sum(-1) == 1).all()
    table = np.random.default_rng(0).standard_normal((5, 4))
    np.testing.assert_allclose(oh @ table, table[ids])


@pytest.mark.parametrize("bad, err", [([5], ValueError), ([-1], ValueError), ([0.5], TypeError)])
def test_one_hot_rejects_bad_ids(bad, err):
    with pytest.raises(err):
        one_hot(bad, 5)


def test_embedding_is_reproducible_from_the_generator():
    a = Embedding(7, 16, rng=np.random.default_rng(3))
    b = Embedding(7, 16, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(a.weight, b.weight)
    assert a.weight.dtype == np.float32
    np.testing.assert_array_equal(a(np.array([4, 4]))[1], a.weight.data[4])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 7\), got values in \[7, 7\]"):
        a([7])
    with pytest.raises(TypeError, match="Generator"):
        Embedding(7, 16, rng=3)


def test_sinusoidal_positions_formula_and_odd_dim():
    P = sinusoidal_positions(5, 7, dtype=np.float64)
    t, i = 3, 2
    assert P.shape == (5, 7)
    assert P[t, 2 * i] == pytest.approx(np.sin(t / 10000 ** (2 * i / 7)))
    assert P[t, 2 * i + 1] == pytest.approx(np.cos(t / 10000 ** (2 * i / 7)))
    assert len({tuple(r) for r in P.round(6)}) == 5  # every position differs


def test_text_to_embeddings_shapes_and_unknowns():
    vocab = Vocabulary.from_texts([SENTENCE])
    emb = Embedding(len(vocab), 32, rng=np.random.default_rng(0))
    tokens, x = text_to_embeddings(SENTENCE, vocab, emb)
    assert tokens == ["the", "cat", "sat", "on", "the", "mat"] and x.shape == (1, 6, 32)
    np.testing.assert_array_equal(x[0, 0], x[0, 4])
    with pytest.warns(UserWarning, match="'dog'"):
        tokens, x = text_to_embeddings("the dog sat", vocab, emb)
    assert x.shape == (1, 3, 32)
    np.testing.assert_array_equal(x[0, 1], emb.weight.data[vocab.unk_id])
    _, xp = text_to_embeddings(SENTENCE, vocab, emb, positions=True)
    assert not np.allclose(xp[0, 0], xp[0, 4])


@pytest.mark.parametrize("text, match", [("", "empty"), ("  \n", "empty"),
                                         ("dogs bark", "none of the words")])
def test_text_to_embeddings_errors(text, match):
    vocab = Vocabulary.from_texts([SENTENCE])
    emb = Embedding(len(vocab), 8, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=match):
        text_to_embeddings(text, vocab, emb)


# ---- word2vec -------------------------------------------------------------------------------
def test_word2vec_embedding_trains_on_own_sentences():
    pytest.importorskip("gensim", reason="gensim (the word2vec extra) is not installed")
    from attnlab.text import Word2VecEmbedding

    sentences = ["the king rules the land", "the queen rules the land",
                 "a cat sat on the mat", "a dog sat on the rug"] * 5
    w2v = Word2VecEmbedding(sentences, dim=16, epochs=20, seed=1)
    again = Word2VecEmbedding(sentences, dim=16, epochs=20, seed=1)
    np.testing.assert_array_equal(w2v.weight, again.weight)  # reproducible
    assert w2v.weight.shape == (len(w2v.vocab), 16)
    assert (w2v.weight[0] == 0).all()  # <pad>
    tokens, x = text_to_embeddings("the king sat", w2v.vocab, w2v)
    assert x.shape == (1, 3, 16)
    np.testing.assert_array_equal(x[0, 1], w2v.vector("king"))
    a, b = w2v.vector("king").astype(np.float64), w2v.vector("queen").astype(np.float64)
    want = a @ b / np.sqrt((a @ a) * (b @ b))
    assert w2v.similarity("king", "queen") == pytest.approx(want, rel=1e-6)


# ---- the tutorial model -----------------------------------------------------------------------
def test_explain_random_is_reproducible_from_its_seed():
    e = explain_random(SENTENCE, seed=0)
    assert e.tokens == ["the", "cat", "sat", "on", "the", "mat"]
    assert e.attentions.shape == (1, 4, 6, 6)
    np.testing.assert_allclose(e.attentions.sum(-1), 1, rtol=1e-5)
    assert e.static.shape == e.contextual.shape == (6, 128)
    np.testing.assert_allclose(e.contextual[0], e.contextual[4], atol=1e-6)  # no positions
    assert any("equal contextual vectors" in n for n in e.notes)
    assert "random" in e.model and e.trace is not None
    again = explain_random(SENTENCE, seed=0)
    np.testing.assert_array_equal(e.contextual, again.contextual)
    other = explain_random(SENTENCE, seed=1)
    assert not np.allclose(e.contextual, other.contextual)


def test_explain_random_with_positions_separates_equal_words():
    e = explain_random(SENTENCE, positions=True, dim=16, heads=2)
    assert not np.allclose(e.contextual[0], e.contextual[4])


def test_explain_random_with_fixed_vocabulary(tmp_path):
    v = Vocabulary.from_words(["the", "cat"])
    v.save(tmp_path / "v.json")
    with pytest.warns(UserWarning, match="'dog'"):
        e = explain_random("the dog", vocab=tmp_path / "v.json", dim=8, heads=2)
    assert e.tokens == ["the", "dog"] and any("<unk>" in n for n in e.notes)
    with pytest.raises(ValueError, match="none of the words"):
        explain_random("dogs bark", vocab=v, dim=8, heads=2)


@pytest.mark.parametrize("kwargs, match", [
    ({"text": ""}, "empty"),
    ({"text": " \t"}, "empty"),
    ({"dim": 10, "heads": 3}, "must divide"),
    ({"dim": 0}, "positive"),
    ({"heads": -1}, "positive"),
    ({"dim": 10**9}, "GiB"),
])
def test_explain_random_rejects_bad_input(kwargs, match):
    kwargs = {"text": SENTENCE, **kwargs}
    with pytest.raises(ValueError, match=match):
        explain_random(**kwargs)


@pytest.mark.parametrize("T,dim,heads", [(200, 64, 4), (60, 256, 2)])
def test_memory_estimate_bounds_the_measured_peak(T, dim, heads):
    import tracemalloc

    text = " ".join(f"w{i}" for i in range(T))
    tracemalloc.start()
    try:
        explain_random(text, dim=dim, heads=heads, trace=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    est = estimate_bytes(T, dim, heads, T + 2)
    assert peak <= est <= 8 * peak, (peak, est)


def test_sizes_over_the_limit_are_refused_before_allocating():
    with pytest.raises(ValueError, match="GiB"):
        explain_random("a b", dim=10**7, heads=1)


def test_registry_runs_the_tutorial_model():
    from attnlab.explain import explain

    e = explain("a b a", model="random", dim=8, heads=2, seed=0)
    assert e.attentions.shape == (1, 2, 3, 3)
