"""From a sentence to contextual vectors: seed 000's run, as functions.

``text -> tokens -> ids -> static vectors X (1, T, D) -> MultiheadAttention -> contextual
vectors (1, T, D)``, with every attention map and the step-by-step trace kept.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from attnlab._validation import positive_int
from attnlab.nn.layers import Embedding
from attnlab.text.embedding import sinusoidal_positions
from attnlab.text.tokenizer import Tokenizer
from attnlab.text.vocab import Vocabulary

if TYPE_CHECKING:
    from attnlab.explain import Explanation

#: The tutorial model refuses sizes whose arrays would need more memory than this.
MAX_BYTES = 1 << 30


def text_to_embeddings(
    text: str,
    vocab: Vocabulary,
    embedding: Callable[[np.ndarray], np.ndarray],
    *,
    tokenizer: Tokenizer | None = None,
    positions: bool = False,
) -> tuple[list[str], np.ndarray]:
    """Tokenize ``text``, look the tokens up, return ``(tokens, X)`` with ``X`` ``(1, T, D)``.

    Unknown words become ``<unk>`` (with a warning naming them) and keep their place; none
    is dropped.

    Args:
        text: the input.
        vocab: maps tokens to ids.
        embedding: maps ids ``(1, T)`` to vectors ``(1, T, D)`` (an :class:`Embedding`,
            a :class:`Word2VecEmbedding`, ...), indexed by ``vocab``'s ids.
        tokenizer: default ``Tokenizer()`` (lower-cases).
        positions: add :func:`sinusoidal_positions`. Without them, equal words get equal
            vectors here and equal contextual vectors after attention.

    Raises:
        ValueError: blank text, or text whose every token is unknown.

    >>> vocab = Vocabulary.from_texts(["The cat sat on the mat"])
    >>> emb = Embedding(len(vocab), 128, rng=np.random.default_rng(0))
    >>> tokens, x = text_to_embeddings("The cat sat on the mat", vocab, emb)
    >>> tokens, x.shape
    (['the', 'cat', 'sat', 'on', 'the', 'mat'], (1, 6, 128))
    """
    tokenizer = tokenizer or Tokenizer()
    tokens = tokenizer(text)
    if not tokens:
        raise ValueError("text is empty: it has no words or punctuation to embed")
    ids = vocab.encode(tokens, warn=False)
    unknown = [t for t, i in zip(tokens, ids, strict=True) if i == vocab.unk_id]
    if len(unknown) == len(tokens):
        shown = ", ".join(repr(t) for t in list(dict.fromkeys(tokens))[:5])
        raise ValueError(f"none of the words of the text is in the vocabulary ({shown})")
    vocab.encode(tokens, warn=True)  # warns about the unknown ones, if any
    x = np.asarray(embedding(ids[None, :]))  # (1, T, D)
    if x.ndim != 3 or x.shape[:2] != (1, len(tokens)):
        raise ValueError(f"embedding returned shape {x.shape}, but should be (1, {len(tokens)}, D)")
    if positions:
        x = x + sinusoidal_positions(len(tokens), x.shape[-1], dtype=x.dtype)
    return tokens, x


def estimate_bytes(T: int, dim: int, heads: int, vocab_size: int) -> int:
    """Rough peak memory (bytes, float32) of the tutorial model and its trace."""
    floats = (
        vocab_size * dim  # embedding table
        + 2 * 4 * dim * dim  # in/out projections, and their copies in the trace
        + 16 * T * dim  # X, Q, K, V, outputs and copies
        + 6 * heads * T * T  # scores, scaled, weights (+ copies)
    )
    return 4 * floats


def check_sizes(T: int, dim: int, heads: int, vocab_size: int) -> None:
    """Raise ``ValueError`` if the tutorial model would need more than :data:`MAX_BYTES`."""
    need = estimate_bytes(T, dim, heads, vocab_size)
    if need > MAX_BYTES:
        raise ValueError(
            f"dim={dim}, heads={heads} on {T} token{'s' if T != 1 else ''} needs about "
            f"{need / 2**30:,.1f} GiB, "
            f"more than the tutorial model's limit of {MAX_BYTES / 2**30:.0f} GiB; "
            "use a smaller --dim or a shorter text"
        )


def explain_random(
    text: str,
    *,
    seed: int = 0,
    dim: int = 128,
    heads: int = 4,
    checkpoint=None,
    positions: bool = False,
    vocab: Vocabulary | str | os.PathLike | None = None,
    **_,
) -> Explanation:
    """Seed 000's tutorial model on ``text``, as an :class:`~attnlab.explain.Explanation`.

    The vocabulary comes from the text (or ``vocab``), the embedding table and the
    :class:`~attnlab.MultiheadAttention` weights are random, drawn from
    ``np.random.default_rng(seed)``: the attention maps show the mechanics, not meaning.

    Args:
        text: the input.
        seed: seed of the Generator that draws the embeddings, then the layer's weights.
        dim: embedding width ``D`` (``embed_dim``).
        heads: number of heads; must divide ``dim``.
        checkpoint: ignored (the registry passes it to every backend).
        positions: add sinusoidal position codes to the token vectors.
        vocab: a fixed :class:`Vocabulary` (or the path of its JSON); unknown words become
            ``<unk>`` with a warning. Default: the text's own words.

    Returns:
        ``Explanation`` with ``attentions`` ``(1, heads, T, T)``, ``static`` (the token
        vectors, ``(T, D)``), ``contextual`` (the layer's output, ``(T, D)``) and ``trace``.

    Raises:
        ValueError: blank text, only unknown words, ``heads`` not dividing ``dim``,
            non-positive or too large sizes.

    >>> e = explain_random("The cat sat on the mat")
    >>> e.tokens, e.attentions.shape, e.static.shape, e.contextual.shape
    (['the', 'cat', 'sat', 'on', 'the', 'mat'], (1, 4, 6, 6), (6, 128), (6, 128))
    >>> # no positions: "the" == "the", up to float32 rounding (as tests/test_text.py checks)
    >>> bool(np.abs(e.contextual[0] - e.contextual[4]).max() < 1e-6)
    True
    """
    import attnlab
    from attnlab.explain import Explanation

    dim = positive_int(dim, "dim")
    heads = positive_int(heads, "heads")
    seed = int(seed)
    if dim % heads:
        raise ValueError(f"heads={heads} must divide dim={dim} (each head gets dim/heads columns)")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    tokenizer = Tokenizer()
    tokens = tokenizer(text)
    if not tokens:
        raise ValueError("text is empty: it has no words or punctuation to embed")
    if vocab is None:
        vocab = Vocabulary.from_texts([text], tokenizer=tokenizer)
    elif not isinstance(vocab, Vocabulary):
        vocab = Vocabulary.load(vocab)
    check_sizes(len(tokens), dim, heads, len(vocab))
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed}")

    rng = np.random.default_rng(seed)
    embedding = Embedding(len(vocab), dim, rng=rng)
    tokens, x = text_to_embeddings(text, vocab, embedding, tokenizer=tokenizer, positions=positions)
    layer = attnlab.MultiheadAttention(dim, heads, bias=False, batch_first=True, rng=rng)
    layer.eval()
    out, weights = layer(x, x, x, average_attn_weights=False)  # (1, T, D), (1, H, T, T)
    tr = attnlab.trace(layer, x, tokens=tokens)

    notes = [
        "random weights: the maps show how attention computes, not what a trained model "
        "has learned"
    ]
    unknown = sorted({t for t in tokens if t not in vocab})
    if unknown:
        notes.append(f"not in the vocabulary, read as <unk>: {', '.join(unknown)}")
    repeated = [w for w, c in Counter(tokens).items() if c > 1]
    if repeated and not positions:
        notes.append(
            "no position codes: equal words (" + ", ".join(repr(w) for w in repeated)
            + ") get equal contextual vectors"
        )
    desc = f"random (tutorial): embed_dim {dim}, {heads} heads, seed {seed}"
    if positions:
        desc += ", sinusoidal positions"
    return Explanation(
        text=text,
        tokens=tokens,
        model=desc,
        attentions=weights,  # (1, H, T, T): one layer
        static=x[0],
        contextual=out[0],
        trace=tr,
        notes=notes,
    )
