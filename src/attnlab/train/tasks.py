"""Multi-query associative recall (MQAR): the look-back task that attention solves.

A sequence lists key/value pairs, then asks for keys again; after each queried key the
model must emit that key's value::

    k3 v7 k0 v2 k9 v7 ... | k0 v2 k3 v7 ...
    (pairs)                 (queries: the loss is on predicting the value after each key)

Keys are tokens ``k0 … k{K-1}``, values ``v0 … v{V-1}``; the vocabulary is keys then values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from attnlab._validation import generator, positive_int

__all__ = ["IGNORE_INDEX", "RecallTask"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class RecallTask:
    """The associative-recall task's sizes.

    Attributes:
        num_keys: distinct key tokens (a sequence uses ``num_pairs`` of them).
        num_values: distinct value tokens (values may repeat within a sequence).
        num_pairs: key/value pairs shown first.
        num_queries: keys asked again (distinct, at most ``num_pairs``).

    >>> task = RecallTask(num_keys=4, num_values=4, num_pairs=2, num_queries=2)
    >>> ids, targets = task.sample(1, rng=np.random.default_rng(0))
    >>> task.decode(ids[0])                     # 2 pairs, then 2 queries
    'k3 v0 k2 v3 k2 v3 k3 v0'
    >>> targets[0]                              # the answers (ids of v3, v0) at the queries
    array([-100, -100, -100, -100,    7, -100,    4, -100])
    """

    num_keys: int = 16
    num_values: int = 16
    num_pairs: int = 8
    num_queries: int = 8

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_pairs", "num_queries"):
            positive_int(getattr(self, name), name)
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs={self.num_pairs} needs as many distinct keys, got num_keys={self.num_keys}"
            )
        if self.num_queries > self.num_pairs:
            raise ValueError(f"num_queries={self.num_queries} must be <= num_pairs={self.num_pairs}")

    @property
    def vocab(self) -> list[str]:
        """Token strings by id: the keys, then the values."""
        return [f"k{i}" for i in range(self.num_keys)] + [f"v{i}" for i in range(self.num_values)]

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 * (self.num_pairs + self.num_queries)

    def to_dict(self) -> dict:
        return asdict(self)

    def sample(self, batch_size: int, *, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``batch_size`` random sequences: ``(ids (B, T), targets (B, T))``, int64.

        ``targets[b, t]`` is the value the model must predict at a queried key (the next
        token), and ``IGNORE_INDEX`` everywhere else.
        """
        B = positive_int(batch_size, "batch_size")
        rng = generator(rng)
        P, Q, K = self.num_pairs, self.num_queries, self.num_keys
        keys = np.argsort(rng.random((B, K)), axis=1)[:, :P]  # distinct keys per row
        values = rng.integers(0, self.num_values, size=(B, P)) + K
        order = np.argsort(rng.random((B, P)), axis=1)[:, :Q]  # which pairs are queried
        q_keys = np.take_along_axis(keys, order, axis=1)
        q_values = np.take_along_axis(values, order, axis=1)
        ids = np.empty((B, self.seq_len), dtype=np.int64)
        ids[:, 0 : 2 * P : 2], ids[:, 1 : 2 * P : 2] = keys, values
        ids[:, 2 * P :: 2], ids[:, 2 * P + 1 :: 2] = q_keys, q_values
        targets = np.full_like(ids, IGNORE_INDEX)
        targets[:, 2 * P :: 2] = q_values
        return ids, targets

    def encode(self, text: str) -> np.ndarray:
        """Space-separated tokens -> ids ``(T,)``; an unknown token raises ``ValueError``."""
        index = {tok: i for i, tok in enumerate(self.vocab)}
        tokens = text.split()
        if not tokens:
            raise ValueError("text is empty: give space-separated tokens such as 'k1 v3 k1'")
        unknown = [t for t in tokens if t not in index]
        if unknown:
            raise ValueError(
                f"unknown tokens {unknown[:5]}: the vocabulary is k0..k{self.num_keys - 1} "
                f"and v0..v{self.num_values - 1}"
            )
        return np.array([index[t] for t in tokens], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        vocab = self.vocab
        return " ".join(vocab[int(i)] for i in np.asarray(ids).reshape(-1))
