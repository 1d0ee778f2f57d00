"""Token vectors: one-hot codes, sinusoidal positions, word2vec.

The random lookup table of the static-vs-contextual view is :class:`attnlab.nn.Embedding` (re-exported as
``attnlab.text.Embedding``): ``N(0, 1)`` rows drawn from the Generator you pass.

Shapes: ``T`` tokens, ``V`` vocabulary size, ``D`` embedding width.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from attnlab._validation import float_dtype, positive_int, shape_error
from attnlab.text.tokenizer import Tokenizer
from attnlab.text.vocab import Vocabulary


def _check_ids(ids, vocab_size: int, name: str = "ids") -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise ValueError(f"{name} contains {bad}, outside the vocabulary [0, {vocab_size})")
    return arr


def one_hot(ids, vocab_size: int, *, dtype=np.float32) -> np.ndarray:
    """One-hot codes (as in cross-attention of one-hot words): ``(...,)`` ids -> ``(..., V)`` with a single 1 per row.

    Multiplying a one-hot row by a ``(V, D)`` table picks that table row, which is all an
    embedding lookup is.

    Args:
        ids: integer ids in ``[0, vocab_size)``, any shape.
        vocab_size: ``V``.
        dtype: the result's dtype.

    >>> one_hot([0, 3], 5)
    array([[1., 0., 0., 0., 0.],
           [0., 0., 0., 1., 0.]], dtype=float32)
    """
    vocab_size = positive_int(vocab_size, "vocab_size")
    arr = _check_ids(ids, vocab_size)
    out = np.zeros((*arr.shape, vocab_size), dtype=dtype)
    np.put_along_axis(out, arr[..., None], 1, axis=-1)
    return out


def sinusoidal_positions(T: int, dim: int, *, dtype=np.float32) -> np.ndarray:
    """The sinusoidal position codes of "Attention Is All You Need": ``(T, D)``.

    ``P[t, 2i] = sin(t / 10000^(2i/D))``, ``P[t, 2i+1] = cos(t / 10000^(2i/D))``.

    Attention itself ignores order: it compares every token with every other as a set.
    Without positions added to the token vectors, two equal words ("the" ... "the") get
    exactly equal contextual vectors, wherever they stand. Adding these codes makes each
    position's vector different.

    >>> P = sinusoidal_positions(4, 6)
    >>> P.shape, P[0].tolist()
    ((4, 6), [0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    """
    T = positive_int(T, "T", allow_zero=True)
    dim = positive_int(dim, "dim")
    pos = np.arange(T, dtype=np.float64)[:, None]  # (T, 1)
    freq = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # (ceil(D/2),)
    angles = pos * freq  # (T, ceil(D/2))
    out = np.empty((T, dim), dtype=np.float64)
    out[:, 0::2] = np.sin(angles)
    out[:, 1::2] = np.cos(angles[:, : dim // 2])
    return out.astype(float_dtype(dtype))


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` of str is salted)."""
    return zlib.crc32(text.encode("utf-8"))


class Word2VecEmbedding:
    """Word vectors trained with gensim's Word2Vec on your own sentences (the polysemy problem: one vector per word).

    Needs the ``word2vec`` extra (``pip install 'attnlab[word2vec]'``); gensim is imported
    when you train. Training uses one worker thread and a process-independent hash, so the
    same sentences and ``seed`` give the same vectors.

    The resulting table has a row per :attr:`vocab` entry: ``<pad>`` is zeros, ``<unk>`` the
    mean of the word vectors.

    Args:
        sentences: texts (``str``, tokenized with ``tokenizer``) or lists of tokens.
        dim: ``D``, the vector width.
        window: context words on each side.
        min_count: ignore words seen fewer times.
        epochs: passes over the sentences (small corpora need many).
        seed: gensim's seed.
        tokenizer: default ``Tokenizer()``.
        dtype: of :attr:`weight`.

    Example (not run here: gensim is optional)::

        w2v = Word2VecEmbedding(["the king rules", "the queen rules"], dim=16)
        tokens, x = text_to_embeddings("the king", w2v.vocab, w2v)   # x: (1, 2, 16)
    """

    def __init__(
        self,
        sentences: Iterable[str] | Iterable[Sequence[str]],
        *,
        dim: int = 64,
        window: int = 5,
        min_count: int = 1,
        epochs: int = 50,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        dtype=np.float32,
    ):
        try:
            from gensim.models import Word2Vec
        except ImportError as exc:
            raise ImportError(
                "Word2VecEmbedding needs gensim: pip install 'attnlab[word2vec]'"
            ) from exc
        self.dim = positive_int(dim, "dim")
        tokenizer = tokenizer or Tokenizer()
        corpus = [tokenizer(s) if isinstance(s, str) else list(s) for s in sentences]
        corpus = [s for s in corpus if s]
        if not corpus:
            raise ValueError("sentences has no words to train on")
        self.model = Word2Vec(
            corpus,
            vector_size=self.dim,
            window=positive_int(window, "window"),
            min_count=positive_int(min_count, "min_count"),
            epochs=positive_int(epochs, "epochs"),
            seed=int(seed),
            workers=1,
            hashfxn=_stable_hash,
        )
        wv = self.model.wv
        if len(wv.index_to_key) == 0:
            raise ValueError(f"no word occurs at least min_count={min_count} times")
        self.vocab = Vocabulary(wv.index_to_key)
        vectors = np.asarray(wv.vectors, dtype=np.float64)
        table = np.zeros((len(self.vocab), self.dim), dtype=np.float64)
        table[1] = vectors.mean(axis=0)
        table[2:] = vectors
        self.weight = table.astype(float_dtype(dtype))
        self.vocab_size = len(self.vocab)

    def __call__(self, ids) -> np.ndarray:
        return self.weight[_check_ids(ids, self.vocab_size)]

    def vector(self, word: str) -> np.ndarray:
        """The ``(D,)`` vector of ``word``; ``KeyError`` if it was not trained."""
        if word not in self.vocab:
            raise KeyError(f"{word!r} is not in the word2vec vocabulary")
        return self.weight[self.vocab[word]]

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of two trained words."""
        va, vb = self.vector(a), self.vector(b)
        return float(va @ vb / (np.linalg.norm(va) * np.linalg.norm(vb)))

    def __repr__(self) -> str:
        return f"Word2VecEmbedding({self.vocab_size} words, dim={self.dim})"


def check_table(weight: np.ndarray, name: str = "embedding") -> np.ndarray:
    """A ``(V, D)`` float table (internal helper)."""
    w = np.asarray(weight)
    if w.ndim != 2:
        raise shape_error(f"{name}.weight", w.shape, "(V, D)")
    return w
