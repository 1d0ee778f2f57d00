"""Writing files so that a failure never leaves a half-written one behind."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    The temporary name keeps ``path``'s suffix (some writers look at it). If ``write`` or
    the rename fails, the temporary file is removed and ``path`` is left as it was.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = atomic_write(Path(d) / "a.txt", lambda tmp: tmp.write_text("hi"))
    ...     p.read_text(), sorted(f.name for f in Path(d).iterdir())
    ('hi', ['a.txt'])
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
