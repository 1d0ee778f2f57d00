"""Threads for attnlab's own parallel loops (the blockwise kernel, the BERT encoder).

NumPy releases the GIL inside matmul and element-wise loops (and the compiled kernels of
the ``fast`` extra release it too), so a small pool of Python threads keeps every core busy,
including on the element-wise work that NumPy runs on one core.

Three rules keep this safe however many Python threads call attnlab at once:

- **BLAS is held to one thread while any pool runs, and restored after the last.** One
  process-wide limiter counts the pools that run (:class:`_BlasLimiter`): the first sets
  BLAS to one thread (with ``threadpoolctl``), the last one out sets it back to what it
  was. Concurrent calls therefore leave BLAS exactly as they found it. While a pool runs,
  other threads' NumPy matmuls also run on one BLAS thread.
- **No nested pools.** A unit of work running on a pool (or a caller's unit) that calls
  an attnlab kernel runs that kernel in its own thread (:func:`in_pool`), so e.g. the BERT
  encoder's pool never starts the blockwise kernel's.
- Without ``threadpoolctl`` a pool runs only where the environment already holds BLAS to
  one thread (``OPENBLAS_NUM_THREADS=1``); otherwise the work runs in the calling thread and
  BLAS uses the cores inside each matmul.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from attnlab._validation import positive_int

_num_threads: int | None = None
_local = threading.local()  # .in_pool: this thread runs units of a pool


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


def in_pool() -> bool:
    """True inside a unit of work of one of attnlab's pools (its calls stay single-threaded).

    >>> in_pool()
    False
    """
    return getattr(_local, "in_pool", False)


def pool_threads(num_threads: int | None) -> int:
    """The threads a pool may use: ``num_threads`` (default :func:`get_num_threads`); 1 inside
    another pool's unit, or when BLAS cannot be held to one thread meanwhile."""
    threads = get_num_threads() if num_threads is None else positive_int(num_threads, "num_threads")
    if in_pool():
        return 1
    if threads > 1 and not (have_threadpoolctl() or blas_single_threaded_by_env()):
        return 1  # let BLAS parallelise each matmul instead (no oversubscription)
    return threads


class _BlasLimiter:
    """One per process: BLAS at one thread while at least one pool runs (reference count).

    ``threadpoolctl`` lets only one "controlling" Python thread change OpenBLAS's shared
    pool and silently ignores the others; the pool that comes last may run on another
    thread than the one that came first, so the controlling thread is cleared around each
    change (under this limiter's lock, so no two changes interleave).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._controller = None  # threadpoolctl controller of the BLAS libraries
        self._limiter = None  # what restores the original limits

    def _blas(self):
        if self._controller is None:
            from threadpoolctl import ThreadpoolController

            self._controller = ThreadpoolController().select(user_api="blas")
        return self._controller

    def _free_controlling_thread(self, controller) -> None:
        for lib in controller.lib_controllers:
            clear = getattr(type(lib), "clear_controlling_thread", None)
            if clear is not None:
                clear(force=True)

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0 and have_threadpoolctl():
                blas = self._blas()
                self._free_controlling_thread(blas)
                self._limiter = blas.limit(limits=1)
                self._free_controlling_thread(blas)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._limiter is not None:
                blas = self._blas()
                self._free_controlling_thread(blas)
                self._limiter.restore_original_limits()
                self._free_controlling_thread(blas)
                self._limiter = None

    @property
    def users(self) -> int:
        """Pools running now (0 when BLAS is as the process had it)."""
        return self._users


BLAS_LIMITER = _BlasLimiter()


@contextmanager
def blas_limit(threads: int):
    """BLAS held to one thread while the block runs, through the process-wide
    :data:`BLAS_LIMITER` (a no-op for ``threads == 1``, where nothing else competes)."""
    if threads == 1:
        yield
        return
    BLAS_LIMITER.acquire()
    try:
        yield
    finally:
        BLAS_LIMITER.release()


def run_units(units: Iterable, run_unit: Callable, threads: int) -> None:
    """Run ``run_unit(unit, scratch)`` for every unit on ``threads`` threads.

    The calling thread works too (it is one of the ``threads``). Each thread keeps its own
    ``scratch`` dict of reusable buffers and pulls the next unit from a shared iterator, so
    long units balance out with short ones. Inside a unit, :func:`in_pool` is True, so
    attnlab calls made there run single-threaded (no nested pools). Inside another pool's
    unit, this runs every unit in the calling thread.
    """
    it = iter(units)
    lock = threading.Lock()
    if in_pool():
        threads = 1

    def loop() -> None:
        scratch: dict = {}
        outer = getattr(_local, "in_pool", False)
        _local.in_pool = True
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                while True:
                    with lock:
                        unit = next(it, None)
                    if unit is None:
                        return
                    run_unit(unit, scratch)
        finally:
            _local.in_pool = outer

    if threads == 1:
        loop()
        return
    with blas_limit(threads), ThreadPoolExecutor(threads - 1, thread_name_prefix="attnlab") as ex:
        futures = [ex.submit(loop) for _ in range(threads - 1)]
        try:
            loop()
        finally:
            for f in futures:
                f.result()
