"""A sweep's dataset: items read from a JSONL file or an iterable, encoded, and cut into
batches of similar length before any work is handed out (so that every engine computes the
same batches).

The dataset is read in windows of ``window`` items; inside a window the items are sorted by
length (then by their place) and cut into batches of at most ``batch_size`` items and
``max_batch_tokens`` padded tokens. A batch's name (window, rank) and contents depend on the
dataset and these settings alone, never on what was already done, so a resumed sweep
forms the same batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from attnlab.sweep.methods import Batch, Method


@dataclasses.dataclass
class Entry:
    """One dataset item as the driver holds it.

    Attributes:
        index: its 0-based place in the dataset.
        line: its 1-based line in the JSONL file (None for an iterable).
        digest: a digest of its raw text (a resumed sweep checks it did not change).
        item: the parsed JSON object (None when it could not be read).
        error: why it cannot run (unreadable, a missing field, ...), else None.
        encoded: what the method's ``encode`` gave (``input_ids`` and extras).
    """

    index: int
    line: int | None
    digest: str
    item: dict | None = None
    error: str | None = None
    encoded: dict | None = None

    @property
    def length(self) -> int:
        return len(self.encoded["input_ids"])

    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"item {self.index}"


def _digest(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def describe(data) -> str:
    """How the dataset is recorded in a sweep's folder: the file's path, or ``"iterable"``."""
    return str(Path(data).resolve()) if isinstance(data, str | os.PathLike) else "iterable"


def count(data) -> int | None:
    """How many items ``data`` holds, where that is cheap to know (a file: its non-blank lines)."""
    if isinstance(data, str | os.PathLike):
        with open(data, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    try:
        return len(data)
    except TypeError:
        return None


def read_entries(data, field: str) -> Iterator[Entry]:
    """The dataset's items, in order: each parsed (a JSONL line: a JSON object, or a JSON
    string taken as ``{field: text}``), or with its error. Blank lines are skipped."""
    if isinstance(data, str | os.PathLike):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"dataset {str(path)!r} is not a file (give a JSONL file: one JSON object a line)")
        index = 0
        with open(path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                entry = Entry(index, line_no, _digest(raw.strip()))
                try:
                    value = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    entry.error = f"line {line_no} is not JSON: {exc}"
                else:
                    _take(entry, value, field)
                yield entry
                index += 1
        return
    if isinstance(data, Mapping | str | bytes) or not isinstance(data, Iterable):
        raise TypeError(f"data must be a JSONL file's path or an iterable of items (dicts, texts or token id "
                        f"lists), got {type(data).__name__}")
    for index, value in enumerate(data):
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, Mapping):
            value = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in value.items()}
        try:
            raw = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
        except (TypeError, ValueError):
            raw = repr(value).encode()
        entry = Entry(index, None, _digest(raw))
        _take(entry, value, field)
        yield entry


def _take(entry: Entry, value, field: str) -> None:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, int) for v in value)):
        value = {field: value}
    if not isinstance(value, Mapping):
        entry.error = (f"{entry.where()}: an item is a JSON object (or a text, or a list of token ids), "
                       f"got {type(value).__name__}")
        return
    entry.item = dict(value)


def encode(entry: Entry, method: Method, model) -> None:
    """Fill ``entry.encoded`` (or ``entry.error``, naming the line) with the method's encoding."""
    if entry.error is not None:
        return
    try:
        entry.encoded = method.encode(entry.item, model)
    except (ValueError, TypeError, KeyError) as exc:
        entry.error = f"{entry.where()}: {exc}"
        return
    limit = getattr(model, "max_positions", None)
    if limit is not None and entry.length > limit:
        entry.error = f"{entry.where()}: {entry.length} tokens, more than the model's {limit}"
        entry.encoded = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """How items are cut into batches (recorded in the sweep's folder)."""

    batch_size: int = 16
    max_batch_tokens: int = 1024
    window: int = 4096

    def batches(self, entries: list[Entry], one_per_batch: bool) -> list[list[Entry]]:
        """The window's runnable entries in batches, named by rank in length order."""
        ready = sorted((e for e in entries if e.error is None), key=lambda e: (e.length, e.index))
        if one_per_batch:
            return [[e] for e in ready]
        out: list[list[Entry]] = []
        current: list[Entry] = []
        for e in ready:  # ascending length: e is the longest of the batch it joins
            if current and (len(current) >= self.batch_size or (len(current) + 1) * e.length > self.max_batch_tokens):
                out.append(current)
                current = []
            current.append(e)
        if current:
            out.append(current)
        return out


def windows(entries: Iterable[Entry], size: int) -> Iterator[list[Entry]]:
    window: list[Entry] = []
    for e in entries:
        window.append(e)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def make_batch(entries: list[Entry], seed: int, left: bool = True) -> Batch:
    """The :class:`Batch` of ``entries``: ids padded (with id 0, masked out) to the longest, on
    the left (decoders) or the right (encoders)."""
    T = max(e.length for e in entries)
    ids = np.zeros((len(entries), T), dtype=np.int64)
    mask = np.zeros((len(entries), T), dtype=np.int64)
    for b, e in enumerate(entries):
        n = e.length
        span = slice(T - n, T) if left else slice(0, n)
        ids[b, span] = e.encoded["input_ids"]
        mask[b, span] = 1
    return Batch(ids, mask, np.array([e.length for e in entries], dtype=np.int64),
                 np.array([e.index for e in entries], dtype=np.int64), tuple(e.item for e in entries),
                 tuple({k: v for k, v in e.encoded.items() if k != "input_ids"} for e in entries), seed, left)
