"""Opening untrusted files: one error type, files checked before they are read."""

from __future__ import annotations

import json
import os
from pathlib import Path

from attnlab._io import file_kind

__all__ = [
    "CheckpointError", "check_tokenizer", "file_kind", "load_tokenizer", "read_json", "read_text", "regular_file",
    "safetensors_weights",
]

# A config file larger than this is refused before it is parsed.
MAX_JSON_BYTES = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint folder or file that attnlab cannot read (the message names the file)."""


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` as a ``Path`` if it is a regular file, else a clear error naming it.

    Raises:
        FileNotFoundError: nothing is there.
        CheckpointError: a directory or a device (or another special file).

    >>> regular_file("/")
    Traceback (most recent call last):
    ...
    attnlab.io.files.CheckpointError: / is a directory, not a file
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from exc
    kind = file_kind(mode)
    if kind is not None:  # never opened: a pipe would block, a device never end
        raise CheckpointError(f"{path} is {kind}, not a {what}")
    return path


def read_text(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, what: str = "text file",
              label: str = "UTF-8 text") -> str:
    """The text of a small file (a config, a chat template), checked: a regular file, at
    most ``max_bytes``, UTF-8.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: anything else, naming the file (``what`` and ``label`` word it).
    """
    path = regular_file(path, what)
    size = path.stat().st_size
    if size > max_bytes:
        raise CheckpointError(f"{path} is {size} bytes; a {what} should be under {max_bytes}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not valid {label}: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from exc


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, kind: type = dict):
    """A JSON object (or, with ``kind=list``, a list) from a small file (a config), checked:
    size, encoding, syntax, kind.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: anything else, naming the file.
    """
    text = read_text(path, max_bytes=max_bytes, what="JSON file", label="JSON")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deep, a 5000-digit number
        raise CheckpointError(f"{path} is not valid JSON: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, kind):
        what = "object" if kind is dict else kind.__name__
        raise CheckpointError(f"{path} should hold a JSON {what}, got {type(data).__name__}")
    return data


def safetensors_weights(folder: str | os.PathLike) -> Path:
    """``folder / "model.safetensors"``; a folder that holds only ``pytorch_model.bin`` (a
    pickle file, which attnlab never loads) gets an error that says to convert it."""
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.exists() and (folder / "pytorch_model.bin").is_file():
        raise CheckpointError(f"{folder} has only pytorch_model.bin (a pickle file, never loaded by attnlab); "
                              "convert it to model.safetensors")
    return weights


def load_tokenizer(path: str | os.PathLike, *, lower_case: bool = False):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``, checked; with ``lower_case`` a
    Lowercase step goes first (as sentence-transformers' ``do_lower_case``)."""
    path = regular_file(path, "tokenizer file (attnlab reads the tokenizers JSON format)")
    from tokenizers import Tokenizer
    from tokenizers import normalizers as norm

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own Exception subclass
        raise CheckpointError(f"{path} is not a valid tokenizer file: {exc}") from exc
    current = tokenizer.normalizer
    if lower_case and not isinstance(current, norm.Lowercase) and not (
        isinstance(current, norm.Sequence) and any(isinstance(n, norm.Lowercase) for n in current)
    ):  # as sentence-transformers' do_lower_case: a Lowercase step first
        steps = list(current) if isinstance(current, norm.Sequence) else [current] if current else []
        tokenizer.normalizer = norm.Sequence([norm.Lowercase(), *steps])
    return tokenizer


def check_tokenizer(tokenizer, vocab_size: int, where) -> None:
    """Every id the tokenizer can produce must have an embedding row."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has ids up to {top} ({n} tokens), but the model "
                              f"has vocab_size={vocab_size} embedding rows")
