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


# The worker threads, kept between calls: starting threads for every call cost about
# 0.1 ms, a tenth of a 1 ms attention call. Idle workers wait on a queue (no spinning).
_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_WORKERS = 0
_EXECUTOR_LOCK = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's worker threads, made on first use and remade larger when a call
    wants more (the old ones finish what they have and exit)."""
    global _EXECUTOR, _EXECUTOR_WORKERS
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None or _EXECUTOR_WORKERS < workers:
            if _EXECUTOR is not None:
                _EXECUTOR.shutdown(wait=False)
            _EXECUTOR = ThreadPoolExecutor(workers, thread_name_prefix="attnlab")
            _EXECUTOR_WORKERS = workers
        return _EXECUTOR


def _forget_executor() -> None:
    """In a forked child the parent's worker threads do not exist: start afresh."""
    global _EXECUTOR, _EXECUTOR_WORKERS, _EXECUTOR_LOCK
    _EXECUTOR, _EXECUTOR_WORKERS, _EXECUTOR_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_executor)


class ScratchPool:
    """Scratch dicts (a kernel's reusable per-thread buffers) kept between calls, so that
    a call reuses the last call's memory instead of fresh pages (on a virtual machine a
    first touch can cost a millisecond per megabyte). Each running thread takes one dict
    and gives it back; at most as many dicts as threads ever ran at once are kept.

    >>> pool = ScratchPool()
    >>> s = pool.take(); s["buf"] = 1; pool.give(s)
    >>> pool.take()
    {'buf': 1}
    """

    def __init__(self) -> None:
        self._free: list[dict] = []
        self._lock = threading.Lock()

    def take(self) -> dict:
        with self._lock:
            return self._free.pop() if self._free else {}

    def give(self, scratch: dict) -> None:
        with self._lock:
            self._free.append(scratch)


def run_units(units: Iterable, run_unit: Callable, threads: int, *, scratch: ScratchPool | None = None) -> None:
    """Run ``run_unit(unit, scratch)`` for every unit on ``threads`` threads.

    The calling thread works too (it is one of the ``threads``); the others are the
    process's worker threads, kept between calls. Each thread has its own ``scratch`` dict
    of reusable buffers (from the ``scratch`` pool where given, so buffers outlive the
    call; else a fresh dict) and pulls the next unit from a shared iterator, so long
    units balance out with short ones. Inside a unit, :func:`in_pool` is True, so
    attnlab calls made there run single-threaded (no nested pools). Inside another pool's
    unit, this runs every unit in the calling thread.
    """
    it = iter(units)
    lock = threading.Lock()
    pool = scratch
    if in_pool():
        threads = 1

    def loop() -> None:
        mine = {} if pool is None else pool.take()
        outer = getattr(_local, "in_pool", False)
        _local.in_pool = True
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                while True:
                    with lock:
                        unit = next(it, None)
                    if unit is None:
                        return
                    run_unit(unit, mine)
        finally:
            _local.in_pool = outer
            if pool is not None:
                pool.give(mine)

    if threads == 1:
        loop()
        return
    ex = _executor(threads - 1)
    with blas_limit(threads):
        futures = [ex.submit(loop) for _ in range(threads - 1)]
        try:
            loop()
        finally:
            for f in futures:
                f.result()
