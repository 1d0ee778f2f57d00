"""``Vocabulary``: words <-> ids, with ``<pad>`` and ``<unk>``, saved as JSON."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from attnlab._validation import positive_int
from attnlab.text.tokenizer import Tokenizer

PAD = "<pad>"
UNK = "<unk>"
_FORMAT = "attnlab-vocabulary"


class Vocabulary:
    """A fixed list of words; a word's id is its position. Ids 0 and 1 are ``<pad>`` and
    ``<unk>``.

    A word not in the vocabulary maps to ``<unk>`` and a warning names it: it is never
    dropped silently (a plain ``if token in vocab`` filter loses words and shifts every
    position after them).

    Args:
        words: the words, in id order after the two special tokens (duplicates and the
            special tokens themselves are skipped).

    >>> vocab = Vocabulary.from_texts(["The cat sat on the mat"])
    >>> len(vocab), vocab.words[:4]
    (7, ['<pad>', '<unk>', 'the', 'cat'])
    >>> vocab.encode(["the", "mat"]).tolist()
    [2, 6]
    >>> vocab.decode([3, 4])
    ['cat', 'sat']
    """

    def __init__(self, words: Iterable[str]):
        self._words: list[str] = [PAD, UNK]
        self._index: dict[str, int] = {PAD: 0, UNK: 1}
        for w in words:
            if not isinstance(w, str):
                raise TypeError(f"words must be strings, got {type(w).__name__} ({w!r})")
            if w not in self._index:
                self._index[w] = len(self._words)
                self._words.append(w)

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_words(cls, words: Iterable[str]) -> Vocabulary:
        """A vocabulary of exactly these words (after ``<pad>``, ``<unk>``)."""
        return cls(words)

    @classmethod
    def from_texts(
        cls,
        texts: Iterable[str],
        *,
        tokenizer: Tokenizer | None = None,
        min_count: int = 1,
        max_size: int | None = None,
    ) -> Vocabulary:
        """A vocabulary of the tokens of ``texts``, in order of first appearance.

        Args:
            texts: strings to tokenize (a single ``str`` is one text).
            tokenizer: default ``Tokenizer()`` (lower-cases).
            min_count: keep words seen at least this often.
            max_size: keep at most this many words (the most frequent; ties by first
                appearance); ``None`` keeps all.
        """
        if isinstance(texts, str):
            texts = [texts]
        tokenizer = tokenizer or Tokenizer()
        min_count = positive_int(min_count, "min_count")
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(tokenizer(text))
        words = [w for w, c in counts.items() if c >= min_count]  # first-appearance order
        if max_size is not None:
            max_size = positive_int(max_size, "max_size")
            keep = set(sorted(words, key=lambda w: -counts[w])[:max_size])
            words = [w for w in words if w in keep]
        return cls(words)

    # ---- lookup ----------------------------------------------------------------------
    @property
    def words(self) -> list[str]:
        """All entries in id order, special tokens first."""
        return list(self._words)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    def __len__(self) -> int:
        return len(self._words)

    def __contains__(self, word: object) -> bool:
        return word in self._index

    def __getitem__(self, word: str) -> int:
        """The id of ``word``, or ``unk_id`` (without a warning; see :meth:`encode`)."""
        return self._index.get(word, self.unk_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self._words == other._words

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} entries)"

    def encode(self, tokens: Sequence[str], *, warn: bool = True) -> np.ndarray:
        """The ids ``(T,)`` (int64) of ``tokens``; unknown ones become ``<unk>``.

        Args:
            tokens: token strings (use the tokenizer the vocabulary was built with).
            warn: emit a ``UserWarning`` listing the unknown words.
        """
        if isinstance(tokens, str):
            raise TypeError("tokens must be a list of strings, got one str (tokenize it first)")
        ids = np.array([self._index.get(t, self.unk_id) for t in tokens], dtype=np.int64)
        if warn:
            unknown = [t for t, i in zip(tokens, ids, strict=True) if i == self.unk_id and t != UNK]
            if unknown:
                shown = ", ".join(repr(w) for w in dict.fromkeys(unknown))
                warnings.warn(
                    f"{len(unknown)} of {len(tokens)} tokens are not in the vocabulary and "
                    f"map to {UNK}: {shown}",
                    UserWarning,
                    stacklevel=2,
                )
        return ids

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The words of ``ids``; raises ``ValueError`` for an id outside ``[0, len)``."""
        out = []
        for i in np.asarray(list(ids)).reshape(-1):
            if not 0 <= int(i) < len(self._words):
                raise ValueError(f"id {int(i)} is outside the vocabulary [0, {len(self._words)})")
            out.append(self._words[int(i)])
        return out

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": _FORMAT, "version": 1, "words": self._words[2:]}

    @classmethod
    def from_dict(cls, data: dict) -> Vocabulary:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"not an attnlab vocabulary (expected \"format\": {_FORMAT!r})")
        words = data.get("words")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ValueError("vocabulary JSON: \"words\" must be a list of strings")
        return cls(words)

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON (UTF-8) to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1), "utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        """Read a vocabulary written by :meth:`save`; ``ValueError`` if it is not one."""
        try:
            data = json.loads(Path(path).read_text("utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {exc.msg}") from None
        return cls.from_dict(data)
