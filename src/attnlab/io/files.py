"""Opening untrusted files: one error type, files checked before they are read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

__all__ = ["CheckpointError", "file_kind", "read_json", "regular_file"]

# A config file larger than this is refused before it is parsed.
MAX_JSON_BYTES = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint folder or file that attnlab cannot read (the message names the file)."""


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, in words (None for a regular file).

    >>> import os
    >>> file_kind(os.stat("/").st_mode)
    'a directory'
    """
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


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
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from None
    kind = file_kind(mode)
    if kind is not None:  # never opened: a pipe would block, a device never end
        raise CheckpointError(f"{path} is {kind}, not a {what}")
    return path


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES, kind: type = dict):
    """A JSON object (or, with ``kind=list``, a list) from a small file (a config), checked:
    size, encoding, syntax, kind.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: anything else, naming the file.
    """
    path = regular_file(path, "JSON file")
    size = path.stat().st_size
    if size > max_bytes:
        raise CheckpointError(f"{path} is {size} bytes; a config file should be under {max_bytes}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, kind):
        what = "object" if kind is dict else kind.__name__
        raise CheckpointError(f"{path} should hold a JSON {what}, got {type(data).__name__}")
    return data
