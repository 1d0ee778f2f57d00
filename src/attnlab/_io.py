"""Writing files so that a failure never leaves a half-written one behind, and never writes
anything but a regular file."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "check_target", "file_kind"]


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


def check_target(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` if a file may be written there: nothing is there yet, or a
    regular file (a link is followed).

    Raises:
        IsADirectoryError: a directory is there.
        FileExistsError: a device, a named pipe or a socket is there (``/dev/null`` is never
            replaced by a regular file).

    >>> check_target("/dev/null")
    Traceback (most recent call last):
    ...
    FileExistsError: [Errno 17] it is a character device; attnlab writes only regular files: '/dev/null'
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or unreadable): the write says why it fails, if it does
        return path
    kind = file_kind(mode)
    if kind == "a directory":
        raise IsADirectoryError(errno.EISDIR, "it is a directory, not a file", str(path))
    if kind is not None:
        raise FileExistsError(errno.EEXIST, f"it is {kind}; attnlab writes only regular files", str(path))
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    The temporary name keeps ``path``'s suffix (some writers look at it). If ``write`` or
    the rename fails, the temporary file is removed and ``path`` is left as it was. A
    ``path`` that holds something other than a regular file is refused before anything is
    written (see :func:`check_target`).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = atomic_write(Path(d) / "a.txt", lambda tmp: tmp.write_text("hi"))
    ...     p.read_text(), sorted(f.name for f in Path(d).iterdir())
    ('hi', ['a.txt'])
    """
    path = check_target(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
