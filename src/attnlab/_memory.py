"""How freed memory goes back to the system: kept for reuse, or returned at once.

A forward and backward pass allocates and frees many arrays of a few megabytes. glibc's
``malloc`` serves such sizes with fresh ``mmap`` pages, or returns the top of its heap to
the system when a large enough block is freed there, so the next call touches fresh pages
again. On a virtual machine each first touch of a page is a fault the hypervisor
handles: measured on this project's 2-core cloud machine, about 3,700 faults (15 MB) per
``MultiheadAttention(512, 8)`` forward+backward at L=512, and ``silu`` of a 512 x 1536
array at 4.0 ms with fresh pages against 0.6 ms with reused ones.

:func:`keep_freed_memory` asks glibc to keep freed memory in the process for the next
allocation instead (what PyTorch's CPU tuning guide gets from jemalloc or tcmalloc, here
from two ``mallopt`` settings). It changes the whole process, so attnlab never does it on
import: the ``attnlab`` command does it for the commands it runs (``attnlab bench
--system-allocator`` leaves it out), and a program calls it once where it wants it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (and are reused); larger ones are mapped and
# unmapped as before, so a one-off giant array still goes back to the system.
MMAP_THRESHOLD = 256 * 2**20
# Free memory at the top of the heap beyond this is returned to the system.
TRIM_THRESHOLD = 1024 * 2**20

_kept = False


def keep_freed_memory() -> bool:
    """Keep freed memory in the process for reuse (glibc on Linux; elsewhere nothing).

    Sets glibc's ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD` (256 MiB: smaller
    arrays come from the heap) and ``M_TRIM_THRESHOLD`` to :data:`TRIM_THRESHOLD` (1 GiB
    of free heap may stay in the process). Repeated calls of a model then reuse the
    pages of the previous call instead of faulting in fresh ones. The process's resident
    memory stays near its peak instead of shrinking between calls. Applies to every
    library in the process (NumPy, torch), and cannot be undone.

    Returns:
        True where it took effect (or already had), False where the C library is not
        glibc (macOS, Windows, musl): nothing changed.

    >>> import attnlab
    >>> attnlab.keep_freed_memory()  # doctest: +SKIP
    True
    """
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    _kept = ok
    return ok


def freed_memory_kept() -> bool:
    """Whether :func:`keep_freed_memory` has taken effect in this process.

    >>> import attnlab
    >>> attnlab.freed_memory_kept()  # doctest: +SKIP
    False
    """
    return _kept


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (musl does not)
            return None
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
