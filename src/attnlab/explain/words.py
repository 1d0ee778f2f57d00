"""One word in two contexts: the polysemy view (static vectors equal, contextual ones not)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from attnlab._validation import layer_number


@dataclass(frozen=True)
class WordComparison:
    """How alike one word's vectors are in two sentences.

    Attributes:
        word: the word compared.
        layer: the layer of the contextual vectors (attnlab's numbering: 0 = embeddings).
        n_layers: the model's number of layers.
        pieces: the word pieces the word became in each sentence.
        contextual: cosine of the word's vectors at ``layer``.
        static: cosine of its static vectors (layer 0: equal in every sentence, so 1).
    """

    word: str
    layer: int
    n_layers: int
    pieces: tuple[list[str], list[str]]
    contextual: float
    static: float


def compare_word(model, sentence_a: str, sentence_b: str, word: str, *, layer: int = -1) -> WordComparison:
    """Cosines of ``word``'s vectors in two sentences through ``model`` (a BertEncoder).

    Both vectors come from ``model.word_vector`` (a word split into several pieces is the
    average of its pieces; the first whole-word occurrence is used). Warns when the word
    becomes the unknown token in a sentence: its vectors then say nothing about the word.

    Args:
        model: a :class:`~attnlab.models.bert.BertEncoder`.
        sentence_a, sentence_b: the two contexts; each must contain ``word``.
        word: the word to compare.
        layer: the contextual vectors' layer: ``0..n`` or negative (default: the last).

    Raises:
        ValueError: an empty word or sentence, a word with a space, a word missing from a
            sentence, a bad layer.
    """
    from attnlab.models.bert import cosine

    if not isinstance(word, str) or not word.strip():
        raise ValueError("word is empty: give the word to compare, e.g. 'bank'")
    word = word.strip()
    if len(word.split()) > 1:
        raise ValueError(f"word must be one word (no spaces), got {word!r}")
    n = model.config.num_hidden_layers
    k = layer_number(layer, n)
    pieces, ctx, static = [], [], []
    for name, text in (("sentence_a", sentence_a), ("sentence_b", sentence_b)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} is empty: give a sentence that contains {word!r}")
        try:
            positions = model.find_word(text, word)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        tokens = model.tokenizer.encode(text).tokens
        ps = [tokens[i] for i in positions]
        unk = getattr(model.tokenizer.model, "unk_token", None) or "[UNK]"
        if unk in ps:
            warnings.warn(
                f"{name}: {word!r} becomes the unknown token {unk}; its vectors say nothing "
                "about the word", stacklevel=2)
        pieces.append(ps)
        ctx.append(model.word_vector(text, word, layer=k))
        static.append(model.word_vector(text, word, layer=0))
    return WordComparison(
        word=word, layer=k, n_layers=n, pieces=(pieces[0], pieces[1]),
        contextual=cosine(*ctx), static=cosine(*static),
    )
