"""Threads for attnlab's own parallel loops (the blockwise kernel, the BERT encoder).

NumPy releases the GIL inside matmul and element-wise loops, so a small pool of Python
threads keeps every core busy, including on the element-wise work that NumPy runs on one
core. While such a pool runs, BLAS is held to one thread per call (with ``threadpoolctl``,
the ``fast`` extra) so the cores are not oversubscribed. Without ``threadpoolctl`` the pool
runs only where the environment already holds BLAS to one thread
(``OPENBLAS_NUM_THREADS=1``); otherwise the work runs in the calling thread and BLAS uses
the cores inside each matmul.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np

from attnlab._validation import positive_int

_num_threads: int | None = None
_controller = None
_controller_lock = threading.Lock()


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def get_num_threads() -> int:
    """Threads attnlab's parallel loops use by default (all usable CPUs unless set).

    >>> get_num_threads() >= 1
    True
    """
    return _num_threads if _num_threads is not None else available_cpus()


def set_num_threads(n: int | None) -> None:
    """Set the default thread count of attnlab's parallel loops (``None``: all usable CPUs).

    Like ``torch.set_num_threads``; a ``num_threads=`` argument overrides it per call.

    >>> set_num_threads(None)
    """
    global _num_threads
    _num_threads = None if n is None else positive_int(n, "n")


def have_threadpoolctl() -> bool:
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return False
    return True


def blas_single_threaded_by_env() -> bool:
    """True when the environment already holds BLAS to one thread (no threadpoolctl needed)."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        if var in os.environ:
            return os.environ[var].strip() == "1"
    return False


def pool_threads(num_threads: int | None) -> int:
    """The threads a pool may use: ``num_threads`` (default :func:`get_num_threads`), or 1
    when BLAS cannot be held to one thread meanwhile."""
    threads = get_num_threads() if num_threads is None else positive_int(num_threads, "num_threads")
    if threads > 1 and not (have_threadpoolctl() or blas_single_threaded_by_env()):
        return 1  # let BLAS parallelise each matmul instead (no oversubscription)
    return threads


def blas_limit(threads: int):
    """A context that holds BLAS to one thread while ``threads`` pool threads run."""
    global _controller
    if threads == 1:
        return nullcontext()
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return nullcontext()
    with _controller_lock:
        if _controller is None:
            _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="blas")


def run_units(units: Iterable, run_unit: Callable, threads: int) -> None:
    """Run ``run_unit(unit, scratch)`` for every unit on ``threads`` threads.

    Each thread keeps its own ``scratch`` dict of reusable buffers and pulls the next unit
    from a shared iterator, so long units balance out with short ones.
    """
    it = iter(units)
    lock = threading.Lock()

    def loop() -> None:
        scratch: dict = {}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            while True:
                with lock:
                    unit = next(it, None)
                if unit is None:
                    return
                run_unit(unit, scratch)

    if threads == 1:
        loop()
        return
    with blas_limit(threads), ThreadPoolExecutor(threads, thread_name_prefix="attnlab") as ex:
        futures = [ex.submit(loop) for _ in range(threads)]
        for f in futures:
            f.result()
