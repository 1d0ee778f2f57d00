"""From a sentence to token vectors: text -> tokens -> ids -> static vectors.

``text -> tokens -> ids -> static vectors X (1, T, D)``; the random-weight teaching model
(:func:`attnlab.explain.random_model`) then runs a ``MultiheadAttention`` on ``X``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attnlab.text.embedding import sinusoidal_positions
from attnlab.text.tokenizer import Tokenizer
from attnlab.text.vocab import Vocabulary

#: The teaching model refuses sizes whose arrays would need more memory than this.
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

    >>> from attnlab.nn import Embedding
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
    """Rough peak memory (bytes, float32) of the teaching model and its trace (an upper
    bound of the measured peak, checked by the tests)."""
    floats = (
        vocab_size * dim  # embedding table
        + 2 * 4 * dim * dim  # in/out projections, and their copies in the trace
        + 16 * T * dim  # X, Q, K, V, outputs and copies
        + 10 * heads * T * T  # scores, scaled, masked, weights (+ the layer's own and copies)
    )
    return 4 * floats


def check_sizes(T: int, dim: int, heads: int, vocab_size: int) -> None:
    """Raise ``ValueError`` if the teaching model would need more than :data:`MAX_BYTES`."""
    need = estimate_bytes(T, dim, heads, vocab_size)
    if need > MAX_BYTES:
        raise ValueError(
            f"dim={dim}, heads={heads} on {T} token{'s' if T != 1 else ''} needs about "
            f"{need / 2**30:,.1f} GiB, "
            f"more than the teaching model's limit of {MAX_BYTES / 2**30:.0f} GiB; "
            "use a smaller --dim or a shorter text"
        )
