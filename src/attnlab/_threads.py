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

And three keep a busy machine from stalling it (other processes on the cores):

- **Nobody waits for a thread that has not started.** Each thread pulls the next unit from
  one shared queue, and a call returns once every unit is done: a worker that the system
  has not yet given a core finds nothing left when it does run, so the caller (and the
  workers that did run) do all the work meanwhile, and the call takes at worst about what
  one thread takes alone, plus the unit a descheduled worker holds.
- **Idle threads sleep**, on a lock or a queue: they never spin on a core that another
  process could use (BLAS's own threads spin after each call; see :func:`matmul`).
- **No thread stays pinned to a CPU.** A pool call that starts after the machine idled
  holds its caller on its CPU for that call alone, and the workers off it (Linux wakes a
  worker on its waker's CPU, and the two then share it for milliseconds); while the
  machine is busy (:func:`watch_the_machine`) there is no pool call, so nothing is held.
  ``ATTNLAB_PIN_THREADS=0`` (read at the first pool call) turns the holding off. The
  pool's size is the CPUs this process may use (``os.sched_getaffinity``), so
  ``taskset`` and container limits are honoured.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import numpy as np

from attnlab._tuning import adapts as _adapts
from attnlab._tuning import thresholds as _thresholds
from attnlab._validation import positive_int

_num_threads: int | None = None
_local = threading.local()  # .in_pool: this thread runs units of a pool
_PIN: list = []  # [whether pool calls keep their threads apart (ATTNLAB_PIN_THREADS)], read at first use


def _pinning() -> bool:
    """Whether pool calls keep the caller and the workers on different CPUs (see
    :func:`_caller_and_workers_apart`): unless ``ATTNLAB_PIN_THREADS`` is ``0``."""
    if not _PIN:
        _PIN.append(os.environ.get("ATTNLAB_PIN_THREADS", "").strip() != "0")
    return _PIN[0]


_cpus: set[int] | None = None


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask), looked up once per process
    (a system call, and layers ask for every product); a forked child looks again."""
    global _cpus
    if _cpus is None:
        try:
            _cpus = set(os.sched_getaffinity(0)) or {0}
        except (AttributeError, OSError):  # not on Linux
            _cpus = set(range(max(1, os.cpu_count() or 1)))
    return _cpus


def available_cpus() -> int:
    """How many CPUs this process may run on (see :func:`_allowed_cpus`).

    >>> available_cpus() >= 1
    True
    """
    return len(_allowed_cpus())


def get_num_threads() -> int:
    """Threads attnlab's parallel loops use by default (all usable CPUs unless set; inside
    a step that :class:`StepThreads` runs on one thread, 1).

    >>> get_num_threads() >= 1
    True
    """
    step = getattr(_local, "step_threads", None)
    if step is not None:
        return step
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
        self._limiter = None  # what restores the original limits (threadpoolctl's limit())
        self._direct_calls = None  # see _direct()
        self._saved = None  # the thread counts to restore (direct calls)

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

    def _direct(self):
        """``[(get, set)]`` of each BLAS library's thread count, straight to the library
        (threadpoolctl >= 3.6's per-library setter: about 1 us a change, against 15 us
        through ``limit()``), or None where threadpoolctl has no such setter."""
        if self._direct_calls is None:
            calls = []
            for lib in self._blas().lib_controllers:
                setter = getattr(lib, "_real_set_num_threads", None)
                if setter is None:
                    calls = False
                    break
                calls.append((lib.get_num_threads, setter))
            self._direct_calls = calls
        return self._direct_calls or None

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0 and have_threadpoolctl():
                direct = self._direct()
                if direct is not None:
                    self._saved = [get() for get, _ in direct]
                    for (_, set_threads), n in zip(direct, self._saved, strict=True):
                        if n is not None and n != 1:
                            set_threads(1)
                else:
                    blas = self._blas()
                    self._free_controlling_thread(blas)
                    self._limiter = blas.limit(limits=1)
                    self._free_controlling_thread(blas)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._saved is not None:
                for (_, set_threads), n in zip(self._direct(), self._saved, strict=True):
                    if n is not None and n != 1:
                        set_threads(n)
                self._saved = None
            elif self._users == 0 and self._limiter is not None:
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
def one_blas_thread():
    """BLAS held to one thread while the block runs, through the process-wide
    :data:`BLAS_LIMITER` (without ``threadpoolctl`` it only counts): for a pool's units,
    and for BLAS calls that must not wake BLAS's own threads, whose idle spin would then
    compete with attnlab's pool (see :func:`matmul`)."""
    BLAS_LIMITER.acquire()
    try:
        yield
    finally:
        BLAS_LIMITER.release()


def blas_limit(threads: int):
    """:func:`one_blas_thread` for a pool of ``threads``; a no-op for ``threads == 1``,
    where nothing else competes."""
    return one_blas_thread() if threads > 1 else nullcontext()


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
                with _TIDS_LOCK:  # the old workers exit: never pin a thread id reused later
                    _WORKER_TIDS.clear()
            _EXECUTOR = ThreadPoolExecutor(workers, thread_name_prefix="attnlab", initializer=_register_worker)
            _EXECUTOR_WORKERS = workers
        return _EXECUTOR


# Where the workers may run (unless ATTNLAB_PIN_THREADS=0). It was opt-in while nothing kept
# pool calls off a busy machine: there, or with several attnlab processes, a thread held on
# one CPU waited for that CPU while another one idled (two processes ran some steps 10 to
# 20 times slower than one alone). Since the busy-machine watch (watch_the_machine) runs a
# busy machine's pool calls on their caller alone, nothing is held there, and on a quiet
# 2-core Zen 4 VM holding brought, settled calls (20 ms apart), SmolLM2-like causal
# attention (9/3 heads, L=512): 3.0 ms against 5.1-5.4 unheld (2.7 back to back either
# way); two such processes side by side 3.3 against 5.4 ms each (back to back 2.7-3.7
# against 5.2); busy.py's three busy loops: decode 41.7 against 39.8 tokens/s, training
# step 54.8 against 63.2 ms; two training processes side by side 28.2-28.7 against
# 26.8-28.4 ms a step. When a call starts after the machine has been idle, Linux
# wakes a worker on the CPU of the thread that woke it (the caller's), and the two share
# that CPU until the load balancer moves one, milliseconds later: measured on a 2-core
# virtual machine, a causal attention call (8 heads, L=1024) took 16-20 ms after a 0.1 s
# pause against 9.4 ms back to back, with both threads busy all along; with the two
# threads kept apart, 9.8-11.7 ms (the worker alone kept off the caller's CPU: 16 ms, as
# the caller itself then moves). So a pool call that starts after such a pause holds the
# caller on its CPU and the workers off it (_caller_and_workers_apart: a few system calls
# per call). Calls that follow one another closely do not hold the caller: holding it
# still cost a TinyTransformer training step (a pool call every few milliseconds, BLAS's
# threads busy in between) 19-20 ms against 16-17 ms unheld, measured on the same machine.
# But once held off a CPU the workers stay off it, and between calls the caller moves
# freely: woken by a worker at the end of a call, or after serial work, it often lands on
# the workers' CPU, and the next close call then shares that CPU with a worker that may
# not leave it. So every call looks where the caller is (one sched_getcpu, about a
# microsecond) and, where it has moved, keeps the workers off its new CPU. Measured on
# that machine, SmolLM2's 512-token prefill: the first layers' products took 9-10 ms
# where the rest took 5, the caller sharing the workers' CPU each time.
_WORKER_TIDS: list[int] = []
_WORKERS_OFF: list[int | None] = [None]  # the CPU the workers are kept off now
_TIDS_LOCK = threading.Lock()


def _register_worker() -> None:
    # A new thread inherits its creator's CPU mask, and the pool's first call creates its
    # workers while it holds the caller on one CPU: undo that, then the next call places it.
    try:
        os.sched_setaffinity(0, _allowed_cpus())
    except (AttributeError, OSError):  # not on Linux, or a mask the system refuses
        pass
    with _TIDS_LOCK:
        _WORKER_TIDS.append(threading.get_native_id())
        _WORKERS_OFF[0] = None  # the new worker is not kept off anything yet


_GETCPU = None  # glibc's sched_getcpu through ctypes; False where there is none


def _sched_getcpu():
    """glibc's ``sched_getcpu`` (the CPU the calling thread runs on), or None."""
    global _GETCPU
    if _GETCPU is None:
        _GETCPU = False
        if hasattr(os, "sched_setaffinity"):
            try:
                import ctypes

                fn = ctypes.CDLL(None).sched_getcpu
                fn.restype = ctypes.c_int
                fn.argtypes = []
                _GETCPU = fn
            except (OSError, AttributeError):
                pass
    return _GETCPU or None


# A pool call that starts within this many seconds of the last one's end is not held.
_HOLD_AFTER_IDLE = 0.01
_LAST_POOL_END = [-math.inf]


@contextmanager
def _caller_and_workers_apart():
    """While the block runs, the workers are kept off the calling thread's CPU (their
    masks change only when the caller has moved). After a pause (no pool call ended in
    the last :data:`_HOLD_AFTER_IDLE` seconds) the caller is also held on its CPU, and its
    own mask restored after. A no-op where the system cannot tell the CPU, and unless
    pinning is asked for (:func:`_pinning`)."""
    if not _pinning():
        yield
        return
    try:
        if time.monotonic() - _LAST_POOL_END[0] >= _HOLD_AFTER_IDLE:
            with _held_apart():
                yield
        else:
            if _WORKER_TIDS:  # keep the workers off the CPU the caller has now
                _workers_off_callers_cpu()
            yield
    finally:
        _LAST_POOL_END[0] = time.monotonic()


def _workers_off_callers_cpu() -> int:
    """Keep the workers off the CPU the calling thread runs on (their masks change only
    when it differs from the last one); return that CPU, or -1 where the system cannot
    tell it or there is no other CPU to send them to."""
    getcpu = _sched_getcpu()
    cpu = getcpu() if getcpu is not None else -1
    if cpu == _WORKERS_OFF[0]:
        return cpu
    allowed = _allowed_cpus()
    if cpu < 0 or cpu not in allowed or len(allowed) < 2:
        return -1
    if _WORKER_TIDS:
        with _TIDS_LOCK:
            for tid in _WORKER_TIDS:
                try:
                    os.sched_setaffinity(tid, allowed - {cpu})
                except OSError:  # a worker that has exited, or a mask the system refuses
                    pass
            _WORKERS_OFF[0] = cpu
    return cpu


@contextmanager
def _held_apart():
    cpu = _workers_off_callers_cpu()
    if cpu < 0:
        yield
        return
    try:
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
    except OSError:
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, mine)
        except OSError:
            pass


def _forget_executor() -> None:
    """In a forked child the parent's worker threads do not exist: start afresh (and look
    at the CPUs again: the child may be pinned elsewhere)."""
    global _EXECUTOR, _EXECUTOR_WORKERS, _EXECUTOR_LOCK, _cpus, _TIDS_LOCK
    _EXECUTOR, _EXECUTOR_WORKERS, _EXECUTOR_LOCK, _cpus = None, 0, threading.Lock(), None
    _WORKER_TIDS.clear()
    _WORKERS_OFF[0] = None
    _TIDS_LOCK = threading.Lock()


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


_END = object()  # no unit left


class _Run:
    """One :func:`run_units` call's shared queue of units and what is left to wait for."""

    __slots__ = ("it", "lock", "active", "closed", "error", "done")

    def __init__(self, units: Iterable) -> None:
        self.it = iter(units)
        self.lock = threading.Lock()
        self.active = 0  # units taken and not finished
        self.closed = False  # no unit will be handed out any more (all taken, or one failed)
        self.error: BaseException | None = None
        self.done = threading.Event()  # closed, and no unit in flight

    def take(self):
        with self.lock:
            if self.closed:
                return _END
            unit = next(self.it, _END)
            if unit is _END:
                self.closed = True
                if self.active == 0:
                    self.done.set()
                return _END
            self.active += 1
            return unit

    def finish(self, error: BaseException | None) -> None:
        with self.lock:
            self.active -= 1
            if error is not None and self.error is None:
                self.error, self.closed = error, True
            if self.closed and self.active == 0:
                self.done.set()


def _work(run: _Run, run_unit: Callable, pool: ScratchPool | None) -> None:
    """Take units of ``run`` until none is left (a thread of :func:`run_units`)."""
    if run.closed:  # a worker that started late: nothing to do, nothing to wait for
        return
    mine = {} if pool is None else pool.take()
    outer = getattr(_local, "in_pool", False)
    _local.in_pool = True
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            while (unit := run.take()) is not _END:
                try:
                    run_unit(unit, mine)
                except BaseException as exc:
                    run.finish(exc)
                    return
                run.finish(None)
    finally:
        _local.in_pool = outer
        if pool is not None:
            pool.give(mine)


def run_units(units: Iterable, run_unit: Callable, threads: int, *, scratch: ScratchPool | None = None) -> None:
    """Run ``run_unit(unit, scratch)`` for every unit on ``threads`` threads.

    The calling thread works too (it is one of the ``threads``); the others are the
    process's worker threads, kept between calls. Each thread has its own ``scratch`` dict
    of reusable buffers (from the ``scratch`` pool where given, so buffers outlive the
    call; else a fresh dict) and pulls the next unit from a shared iterator, so long
    units balance out with short ones, and the call returns when every unit is done,
    without waiting for a worker that has not started (on a busy machine the threads that
    run do its share). Inside a unit, :func:`in_pool` is True, so attnlab calls made there
    run single-threaded (no nested pools). Inside another pool's unit, this runs every
    unit in the calling thread. The first exception a unit raises stops the handing out
    of units and is raised here once the units in flight are done.

    >>> out = []
    >>> run_units(range(4), lambda i, _s: out.append(i * i), 2)
    >>> sorted(out)
    [0, 1, 4, 9]
    """
    if in_pool() or (threads > 1 and watch_the_machine()):
        threads = 1  # on a busy machine, waking a worker costs more than it brings (see watch_the_machine)
    _run_on(units, run_unit, threads, scratch)


def _run_on(units: Iterable, run_unit: Callable, threads: int, scratch: ScratchPool | None = None) -> None:
    """:func:`run_units` on exactly ``threads`` threads, whatever the machine's load (the
    tuning's measurement of the pool's cost runs here)."""
    run = _Run(units)
    if threads == 1:
        _work(run, run_unit, scratch)
    else:
        ex = _executor(threads - 1)
        with blas_limit(threads), _caller_and_workers_apart():
            for _ in range(threads - 1):
                ex.submit(_work, run, run_unit, scratch)
            _work(run, run_unit, scratch)
            run.done.wait()
    if run.error is not None:
        raise run.error


# When matmul() splits a product over attnlab's threads instead of BLAS's own: over at least
# POOL_MATMUL_MIN_TOKENS tokens (the rows of a projection, the inner dimension of a weight
# gradient) and where tokens x width^2 reaches pool_matmul_min() (attnlab._tuning: where one
# thread's work takes 8x a pool call, from the figures measured on this machine), ``width``
# being the narrower of the product's two sides beside the token axis. A pool call costs about
# 100 us of thread wake-ups on a 2-core cloud machine against BLAS's ~10 us (its threads spin),
# so small products keep BLAS's threads. Tokens x width^2 is a layer's smallest product, the
# same for each of a transformer layer's projections and their gradients (their narrower side
# is the layer's width: d -> 3d, d -> d, d -> 4d, 4d -> d), so a layer's products all take one
# side: counted by each product's own multiply-adds, the larger ones of a small layer went to
# the pool and the rest to BLAS's threads, whose spin then slowed the pool's. And once a
# product has been split, every product over as many tokens is split for POOL_SPAN seconds (but
# a low-rank adapter's, _skinny, and one too small to cut in two parts), whatever its size (a
# small vocabulary's output layer beside large ones, whose narrower side is not the layer's):
# one product on BLAS's threads leaves them spinning for about a tenth of a second (OpenBLAS's
# 2^28 cycles) beside everything the pool runs then. Measured on a 2-core AVX-512 EPYC (Zen 4),
# microseconds per product back to back, BLAS's 2 threads / attnlab's: 2048x64x64 99 / 199,
# 2048x64x192 278 / 403, 64x576x576 305 / 391, 512x576x1536 (453M) 4650 / 5250 alone; but
# beside the attention kernel's pool: MultiheadAttention(512, 8) forward+backward at L=512 took
# 43-62 ms with BLAS's threads, 32.5 ms with attnlab's. A TinyTransformer training step (batch
# 32 x 40 tokens, AdamW), ms, medians of 10 rounds in turns, each product by its own
# multiply-adds / these rules / torch: d_model 96 28.1 / 18.7 / 29.7, 128 45.0 / 34.9 / 31.8,
# 192 68.5 / 46.0 / 44.4, 256 105.8 / 70.8 / 69.8 (in another run, every product on BLAS's
# threads: 20.0, 48.6 and 76.1 at 96, 192 and 256; every one split: 25.6, 44.7, 71.8). The
# token rule is BLAS's (its packing of the smaller operand), not the CPU's. Split or not, each
# output is the same dot product over the same inner axis: OpenBLAS gives the same numbers bit
# for bit either way (checked on ten shapes from 40 to 6144 wide).
POOL_MATMUL_MIN_TOKENS = 256
#: Seconds after a product split by its size during which every product over as many tokens
#: is split too (see above).
POOL_SPAN = 0.1
_SPLIT_AT = [-math.inf]  # time.monotonic() of the last product split by its size


def pool_matmul_min() -> int:
    """Tokens x width^2 (multiply-adds of a layer's smallest product) from which
    :func:`matmul` splits a product over attnlab's threads (:func:`attnlab._tuning.thresholds`).

    >>> pool_matmul_min() >= 1
    True
    """
    return _thresholds().pool_matmul_min


# Fewest rows (columns) of the product per thread: below, the blocks lose BLAS's rate.
_MATMUL_MIN_ROWS = 32


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None, *, tokens: int | None = None) -> np.ndarray:
    """``a @ b`` for 2-D NumPy arrays ``(M, K) @ (K, N) -> (M, N)``, large products split
    over attnlab's threads (by rows of ``a`` or columns of ``b``), each part a one-thread
    BLAS call.

    Why not BLAS's own threads: OpenBLAS's idle worker threads spin (on x86-64 with no
    yield) for about 2^28 cycles, a tenth of a second, after every multi-threaded call. A
    layer that follows a BLAS-threaded projection with attnlab's pool (the attention
    kernel, element-wise passes) then runs its threads beside a spinning one on the same
    cores: measured on a 2-core machine, ``MultiheadAttention(512, 8)`` forward+backward
    at L=512 took 43 ms so, against 31 ms with the spin cut short. Splitting the products
    here keeps every thread of a layer in one pool, whose idle threads sleep.

    A product is split where its layer is large: over at least
    :data:`POOL_MATMUL_MIN_TOKENS` tokens, with tokens x width^2 (``width`` the narrower of
    its two sides beside the token axis: a layer's smallest product, so that all of a
    layer's products take one side) at least :func:`pool_matmul_min`; and any product over
    as many tokens within :data:`POOL_SPAN` seconds of one split so (one on BLAS's threads
    would leave them spinning beside the pool's). Others (where a pool call's thread
    wake-ups would cost more than the spin does), a decoding step's matrix-vector products,
    calls inside a pool's unit, one thread, and other ranks take one plain ``np.matmul`` on
    BLAS's threads, except many tokens through a thin side (:func:`_skinny`: a LoRA
    adapter's products, on one BLAS thread; on BLAS's threads their spin made the rest of a
    SmolLM2 forward pass 1.8 times slower); a few rows times a weight's transpose (a short
    prompt's projection) take it weight first, ``(b.T @ a.T).T``, which OpenBLAS runs faster
    (see :func:`_weight_first`).

    ``tokens``: the length of the token axis of the product (None: its rows, ``M``, as in
    a projection; a weight gradient ``grad^T @ x`` passes its inner dimension).

    >>> a = np.arange(6.0).reshape(2, 3)
    >>> matmul(a, a.T)
    array([[ 5., 14.],
           [14., 50.]])
    """
    if get_num_threads() > 1:
        watch_the_machine()
    if not _pooled(a, b, tokens):
        if _weight_first(a, b):
            out = _product_out(a, b, out)
            np.copyto(out, np.matmul(b.T, a.T).T)
            return out
        if _skinny(a, b, tokens):
            with one_blas_thread():
                return np.matmul(a, b, out=out)
        return np.matmul(a, b, out=out)
    out = _product_out(a, b, out)
    units = _product_parts(a, b, out, get_num_threads())
    run_units(units, _product_unit, len(units))
    return out


def matmuls(pairs, *, tokens: int | None = None) -> list[np.ndarray]:
    """``[a @ b for a, b in pairs]``: independent products (a layer's input gradients for
    its query, key and value weights; a weight's and an input's gradient) in one pool call,
    each split as :func:`matmul` splits it, so that the pool's threads wake once, not once
    a product. Where one of them would not be split (:func:`matmul`'s rule, ``tokens`` as
    there), each is its own :func:`matmul`.

    >>> a = np.arange(6.0).reshape(2, 3)
    >>> [m.tolist() for m in matmuls([(a, a.T), (a.T, a)])][0]
    [[5.0, 14.0], [14.0, 50.0]]
    """
    pairs = list(pairs)
    if not pairs or not all(_pooled(a, b, tokens) for a, b in pairs):
        return [matmul(a, b, tokens=tokens) for a, b in pairs]
    threads = get_num_threads()
    outs = [_product_out(a, b, None) for a, b in pairs]
    units = [u for (a, b), out in zip(pairs, outs, strict=True) for u in _product_parts(a, b, out, threads)]
    run_units(units, _product_unit, min(threads, len(units)))
    return outs


# A few rows times a weight's transpose, ``x @ W.T`` with ``W (N, K)`` C-contiguous (a
# layer's projection of a short prompt), run faster as ``W @ x.T`` and a transposed copy
# of its ``(N, M)`` result (most likely because OpenBLAS then packs the few rows of x,
# not the whole weight, as its transposed operand). Same products, and the same numbers
# bit for bit on the shapes measured (176 products, 2 to 64 rows, 1 and 2 threads).
# Measured on a 2-core AVX-512 EPYC (Zen 4), time of the weight-first product and its
# copy over the plain product's, K -> N = 576 -> 1536, 1536 -> 576, 576 -> 960, 576 ->
# 576, 768 -> 2304, 768 -> 3072, 3072 -> 768, 384 -> 1152, 1536 -> 384, on 2 BLAS
# threads: M = 8-16 0.44-0.74, M = 32 0.67-0.79, M = 64 0.80-1.01, M = 128 0.92-1.11, M
# = 255 1.06-1.25; on one thread M = 64 0.81-0.91, M = 128 0.90-1.03. Products with a
# side under 256 (64 -> 192, 128 -> 64) gained nothing at M = 64 (1.11-1.46).
_WEIGHT_FIRST_MAX_ROWS = 64
_WEIGHT_FIRST_MIN_SIDE = 256


def _weight_first(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether :func:`matmul` runs ``a @ b`` as ``(b.T @ a.T).T`` (see above): float32,
    2 to 64 rows in ``a`` (C-contiguous), ``b`` the transposed view of a C-contiguous
    matrix, both of its sides at least 256."""
    return (a.ndim == 2 and b.ndim == 2 and 2 <= a.shape[0] <= _WEIGHT_FIRST_MAX_ROWS
            and min(a.shape[1], b.shape[1]) >= _WEIGHT_FIRST_MIN_SIDE
            and a.dtype == np.float32 and b.dtype == np.float32
            and a.flags.c_contiguous and b.flags.f_contiguous)


def _skinny(a: np.ndarray, b: np.ndarray, tokens: int | None) -> bool:
    """Whether ``a @ b`` runs many tokens through a side thinner than :data:`_MATMUL_MIN_ROWS`
    (a low-rank adapter's ``x A^T``, ``u B^T`` and their gradients): one BLAS thread does it
    in microseconds, where BLAS's own threads would then spin beside the pool's (see
    :func:`matmul`; a decoding step's products have one token and keep BLAS's threads)."""
    if a.ndim != 2 or b.ndim != 2:
        return False
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    return min(M, K, N) < _MATMUL_MIN_ROWS <= (M if tokens is None else tokens)


def _pooled(a: np.ndarray, b: np.ndarray, tokens: int | None) -> bool:
    """Whether :func:`matmul` splits ``a @ b`` over the pool (see there); notes the time
    when its size decides."""
    M, K = a.shape[-2:] if a.ndim >= 2 else (1, a.shape[-1])
    N = b.shape[-1] if b.ndim >= 2 else 1
    t = M if tokens is None else tokens
    if (a.ndim != 2 or b.ndim != 2 or get_num_threads() == 1 or max(M, N) < 2 * _MATMUL_MIN_ROWS or _WATCH["busy"]
            or t < POOL_MATMUL_MIN_TOKENS or in_pool() or not (have_threadpoolctl() or blas_single_threaded_by_env())):
        return False
    width = min(M, N) if tokens is not None and tokens != M and tokens == K else min(K, N)
    now = time.monotonic()
    if t * width * width >= pool_matmul_min():
        _SPLIT_AT[0] = now
        return True
    return now - _SPLIT_AT[0] < POOL_SPAN and not _skinny(a, b, tokens)


def _product_out(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    return np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b)) if out is None else out


def _product_parts(a: np.ndarray, b: np.ndarray, out: np.ndarray, threads: int) -> list[tuple]:
    """``a @ b`` as ``(a_part, b_part, out_part)`` units, one a thread: by rows of ``a`` where
    ``M > N``, else by columns of ``b``. Each thread packs (copies into BLAS's layout) all of
    the operand it does not split: split the larger one. A prompt's activations against a
    weight matrix (M < N) split the weight's columns, so each thread reads half the weights."""
    M, N = a.shape[0], b.shape[1]
    by_rows = M > N
    n = M if by_rows else N
    parts = min(threads, max(1, n // _MATMUL_MIN_ROWS))
    step = -(-n // parts)
    step = -(-step // 16) * 16  # whole SIMD-friendly blocks
    if by_rows:
        return [(a[r:r + step], b, out[r:r + step]) for r in range(0, n, step)]
    return [(a, b[:, r:r + step], out[:, r:r + step]) for r in range(0, n, step)]


def _product_unit(part: tuple, _scratch) -> None:
    a, b, out = part
    np.matmul(a, b, out=out)


class StepThreads:
    """The threads for a step that repeats many times (a decoding step), chosen by how fast
    the step runs now: all of attnlab's threads (:func:`get_num_threads`), or one.

    On a quiet machine every thread helps a decoding step (its products read the weights
    from memory, and two threads read faster than one). On a machine that other
    processes keep busy the same threads stall: the compiled kernels' threads (numba's
    OpenMP) and BLAS's spin between the step's many short parallel regions, and a region
    waits for a thread that has no core (SmolLM2 quantized on a 2-core EPYC, other
    processes keeping the load at 3 to 7: 2.6 to 13 tokens/s on two threads against 57 to
    87 on one). Neither is right everywhere, so :meth:`step` times each step and now and
    then runs a few steps the other way (a probe: :data:`PROBE_STEPS` steps after the
    first :data:`FIRST_PROBE`, then after :data:`EVERY` steps, twice as long after each
    probe that loses, up to :data:`MAX_EVERY`; a probe step twice as slow ends the probe
    at once), keeping whichever ran faster. A generation's first step (``step(first=True)``)
    and the first after a pause of :data:`PAUSE` seconds are not counted: they pay for what
    came before them (after a 3,000-token prompt, 42 ms against 12 ms for the next, which made
    one thread look faster and kept it for 32 steps at half the speed). Nor are the steps
    before them: a probe compares steps of one generation only, since another model's or
    another context's steps take another time (SmolLM2 float32 steps of 19 ms, followed by
    the quantized model's 9 ms steps, made its 14 ms one-thread probe look faster: 32 steps
    at 14 ms). A probe needs two steps of the arm in use to compare with. When the steps
    slow down by half (a new load) it probes at once. A probe of all threads is put off
    while other processes hold the cores the extra threads would need
    (:func:`watch_the_machine`'s last look: a probe step on taken cores can cost as much as
    a hundred steps on one), and the process's first step starts on one thread when that is
    so. The arm in use is the process's, kept from one generation to the next. Each step's
    numbers do not depend on its thread count (each output is computed by one thread either
    way).
    """

    FIRST_PROBE = 2
    PROBE_STEPS = 3
    LOSING = 2.0  # a probe step this much slower than the arm in use ends the probe
    EVERY = 32
    MAX_EVERY = 1024
    SLOWER = 1.5  # steps this much slower than when last decided: probe now
    PAUSE = 1.0  # seconds between two steps after which the machine may have changed

    def __init__(self, clock=time.perf_counter, taken=None) -> None:
        self._clock = clock
        self._taken = _cores_taken if taken is None else taken
        self._first = True
        self._lock = threading.Lock()
        self._one = False  # the arm in use: one thread (True) or all (False)
        self._every = self.EVERY
        self._until_probe = self.FIRST_PROBE
        self._probe_left = 0  # steps of the running probe still to run
        self._probe: list[float] = []  # the probe's step times
        self._recent: list[float] = []  # the arm in use's last step times
        self._baseline: float | None = None  # its median when last decided
        self._last_end = -math.inf

    def _pick_one(self, first: bool = False) -> bool:
        """One thread for the next step? (under the lock; the cores' state is the busy-machine
        watch's last look, :func:`_cores_taken`)"""
        if self._first:  # the process's first step: all threads, unless the cores are taken now
            self._first = False
            self._one = self._taken()
        paused = self._clock() - self._last_end > self.PAUSE
        if first or paused:  # a new generation, or the machine may have changed: compare anew
            self._recent, self._baseline, self._probe, self._probe_left = [], None, [], 0
            if paused:
                self._until_probe = min(self._until_probe, self.FIRST_PROBE)
        if self._probe_left == 0 and self._until_probe <= 0 and len(self._recent) >= 2:
            if self._one and self._taken():  # the cores are taken: the probe would only lose
                self._every = min(2 * self._every, self.MAX_EVERY)
                self._until_probe = self._every
            else:
                self._probe_left, self._probe = self.PROBE_STEPS, []
        return self._one != (self._probe_left > 0)

    def _record(self, one: bool, seconds: float, first: bool = False) -> None:
        now = self._clock()
        # a generation's first step, or one after a pause (the process's first among them)
        cold = first or now - seconds - self._last_end > self.PAUSE
        self._last_end = now
        if cold:  # it times what came before it (a prompt's leftovers, cold caches), not its threads
            return
        if one != self._one:  # a probe step
            self._probe.append(seconds)
            self._probe_left -= 1
            mine = _median(self._recent[-self.PROBE_STEPS - 2:]) if self._recent else math.inf
            if seconds > self.LOSING * mine:  # clearly slower: no need to run the rest of the probe
                self._probe_left = 0
            if self._probe_left == 0:
                if _median(self._probe) < 0.95 * mine:
                    self._one, self._every = one, self.EVERY
                    self._recent, self._baseline = list(self._probe), _median(self._probe)
                else:
                    self._every = min(2 * self._every, self.MAX_EVERY)
                    self._baseline = mine
                self._until_probe = self._every
            return
        self._recent = (self._recent + [seconds])[-8:]
        self._until_probe -= 1
        if self._baseline is None and len(self._recent) >= 3:
            self._baseline = _median(self._recent)
        elif self._baseline is not None and len(self._recent) >= 3 \
                and _median(self._recent[-3:]) > self.SLOWER * self._baseline:
            self._until_probe, self._baseline = 0, None  # slower by half: probe now

    @contextmanager
    def step(self, *, first: bool = False):
        """Run one step (a ``with`` block) on the thread count chosen for it; yields it.
        ``first``: the first step of a generation (its time is not counted, and the steps
        before it are not compared with the ones after). With one thread, BLAS is held to
        one thread too and :func:`get_num_threads` is 1 inside the block (the compiled
        kernels follow it)."""
        wanted = get_num_threads()
        if wanted == 1 or in_pool() or not _adapts():  # ATTNLAB_TUNE=off: no timing decides
            yield wanted
            return
        with self._lock:
            one = self._pick_one(first)
        outer = getattr(_local, "step_threads", None)
        t0 = self._clock()
        try:
            if one:
                _local.step_threads = 1
                with one_blas_thread():
                    yield 1
            else:
                yield wanted
        finally:
            _local.step_threads = outer
            seconds = self._clock() - t0
            with self._lock:
                self._record(one, seconds, first)

    @property
    def one_thread(self) -> bool:
        """Whether the steps run on one thread now (outside a probe)."""
        return self._one


# ---- a machine that other processes keep busy ------------------------------------------
# BLAS's threads spin between calls (OpenBLAS's for about 2^28 cycles after each, on x86-64
# without yielding), and the calls of a layer come microseconds apart: on a quiet machine
# that keeps them ready, but where other processes want the cores, a call waits for a thread
# that spins on a core it shares, or has lost it. Measured on a 2-core EPYC, other processes
# keeping the load at 6 to 9: a TinyTransformer training step (d_model 96, batch 32 x 40)
# took 214 ms with BLAS's 2 threads against 10 ms on a quiet machine. attnlab's own pool
# never spins, but waking a worker there costs the caller a time slice (the woken thread
# takes the caller's core: 2.6 ms a wake-up in the same run, against 0.1 ms on a quiet
# machine). So every call of matmul() and run_units() looks at the machine, at most every
# BUSY_CHECK_SECONDS: while other processes keep more of this process's CPUs busy than
# attnlab's extra threads can spare (by half a core; /proc/stat's busy time on those CPUs
# less this process's own CPU time, so a container on a larger host counts only its CPUs),
# at two looks in a row, BLAS is held to one thread
# (BLAS_LIMITER, released at the first look that finds the cores free again) and the pools
# run on the calling thread alone: attnlab then does what one thread does, on whichever
# core it gets (the same step: 64 ms, against 61 ms pinned to one core with taskset).
BUSY_CHECK_SECONDS = 0.1
_WATCH = {"busy": False, "seen": False, "at": -math.inf}
_WATCH_LOCK = threading.Lock()


def watch_the_machine() -> bool:
    """Whether the machine is busy with other processes now (see above; looked at most every
    :data:`BUSY_CHECK_SECONDS`), holding BLAS to one thread while it is. False where the
    system does not say (:func:`_other_cores`), and with ``ATTNLAB_TUNE=off``
    (:func:`attnlab._tuning.adapts`).

    >>> isinstance(watch_the_machine(), bool)
    True
    """
    if not _adapts():
        if _WATCH["busy"]:  # turned off while it held BLAS: let go
            with _WATCH_LOCK:
                if _WATCH["busy"]:
                    _WATCH["busy"] = _WATCH["seen"] = False
                    BLAS_LIMITER.release()
        return False
    now = time.monotonic()
    if now - _WATCH["at"] < BUSY_CHECK_SECONDS or not _WATCH_LOCK.acquire(blocking=False):
        return _WATCH["busy"]
    try:
        _WATCH["at"] = now
        others = _other_cores()
        taken = others is not None and others > available_cpus() - get_num_threads() + 0.5
        busy = taken and _WATCH["seen"]  # two looks in a row: a daemon's moment is not a load
        _WATCH["seen"] = taken
        if busy != _WATCH["busy"]:
            if busy:
                BLAS_LIMITER.acquire()
            else:
                BLAS_LIMITER.release()
            _WATCH["busy"] = busy
        return busy
    finally:
        _WATCH_LOCK.release()


def _cores_taken() -> bool:
    """Whether the watch's last look found the cores the extra threads need taken by other
    processes (one look: a decoding step's choice may act at once)."""
    watch_the_machine()
    return _WATCH["seen"]


_TICK = 0.01  # seconds per /proc/stat tick (USER_HZ, 100 on Linux)
_LAST_SAMPLE: list = []  # [(monotonic, process_time, {cpu: (busy ticks, all ticks)})]


def _cpu_ticks(cpus: set[int]) -> dict[int, tuple[int, int]] | None:
    """``{cpu: (busy ticks, all ticks)}`` from Linux's ``/proc/stat`` for ``cpus`` (idle and
    iowait are not busy; a hypervisor's steal is), or None where the system does not say."""
    found = {}
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line[3:4] == b" ":
                    if found:
                        break
                    continue
                name, *fields = line.split()
                cpu = int(name[3:])
                if cpu in cpus:
                    ticks = [int(x) for x in fields[:8]]
                    found[cpu] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    except (OSError, ValueError):
        return None
    return found or None


def _other_cores() -> float | None:
    """How many of this process's CPUs other processes kept busy since the last call: the
    busy time ``/proc/stat`` counts on them, less this process's own CPU time, over the wall
    time between (at most a second back; None the first time, after a longer pause, or where
    the system does not say)."""
    now, mine = time.monotonic(), time.process_time()
    ticks = _cpu_ticks(_allowed_cpus())
    last = _LAST_SAMPLE[0] if _LAST_SAMPLE else None
    _LAST_SAMPLE[:] = [] if ticks is None else [(now, mine, ticks)]
    if ticks is None or last is None or not (0 < now - last[0] <= 1.0):
        return None
    busy = sum(b - last[2][c][0] for c, (b, _) in ticks.items() if c in last[2])
    return max(0.0, (busy * _TICK - (mine - last[1])) / (now - last[0]))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


#: The decoding steps' chooser (:func:`attnlab.models.generate.generate` runs each step in it).
DECODE_STEPS = StepThreads()

