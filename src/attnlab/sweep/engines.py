"""Where a sweep's batches are computed: ``serial`` (this process), ``processes`` (local
worker processes) and ``ray`` (Ray actors, on this machine or a cluster).

Every engine runs :func:`run_batch` on the same batches with the same thread count, so all
three give the same numbers bit for bit; they differ only in where it runs. Workers compute
and send results back; the driver alone writes the sweep's folder.

- ``processes``: ``workers`` processes (started with ``spawn``), each loading the model once
  from the float32 weights the driver wrote to one safetensors file (in the sweep's folder,
  ``OUT/worker-weights``), which every worker memory-maps read-only (one copy in the OS
  page cache, however many workers). Each worker holds BLAS and attnlab's pools to
  ``threads`` threads; with ``threads > 1`` and enough CPUs each worker is confined to CPUs
  of its own, so that no two pin threads to one core. A worker that dies is replaced, and
  its batch retried once; a batch that kills two workers is recorded as failed.
- ``ray``: one actor per worker (``num_cpus=threads``), each rebuilding the model around
  weights put once in Ray's object store (one copy per machine, mapped by every actor
  there). ``address=`` joins a running cluster (probed first, see :func:`probe`: an address
  where no Ray cluster answers fails within seconds); without it a local one-node cluster
  is started on 127.0.0.1 and stopped at the end (one already running in this process is
  used and kept).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Iterator

from attnlab.sweep._store import SweepError, split_results
from attnlab.sweep.methods import Batch, Method

__all__ = ["ENGINES", "Outcome", "compute_threads", "run_batch"]

ENGINES = ("serial", "processes", "ray")
"""The engines a sweep runs on (``engine=``): this process, local worker processes, Ray actors."""


class Outcome:
    """A batch's results: per item ``results[b]`` (``{name: value}``) or ``errors[b]``
    (text); ``alone[b]`` when item ``b`` was recomputed alone after its batch failed."""

    __slots__ = ("results", "errors", "alone")

    def __init__(self, results, errors, alone):
        self.results, self.errors, self.alone = results, errors, alone

    @classmethod
    def failed(cls, n: int, error: str) -> Outcome:
        return cls([None] * n, [error] * n, [False] * n)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_batch(model, method: Method, batch: Batch) -> Outcome:
    """``method(model, batch)`` split per item. Where the batch raises, each of its items
    runs alone, so that only the items that fail are recorded as failed (with the error)."""
    try:
        return Outcome(split_results(method(model, batch), len(batch)), [None] * len(batch), [False] * len(batch))
    except Exception as exc:  # a method's error belongs to the items, not to the sweep
        if len(batch) == 1:
            return Outcome([None], [_error_text(exc)], [False])
    results, errors = [], []
    for b in range(len(batch)):
        try:
            results.append(split_results(method(model, batch.one(b)), 1)[0])
            errors.append(None)
        except Exception as exc:
            results.append(None)
            errors.append(_error_text(exc))
    return Outcome(results, errors, [True] * len(batch))


@contextlib.contextmanager
def compute_threads(threads: int):
    """BLAS and attnlab's own pools held to ``threads`` threads inside the block (restored after)."""
    from attnlab import _threads

    before = _threads._num_threads
    _threads.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # attnlab's pools follow set_num_threads; BLAS as the environment says
        limits = contextlib.nullcontext()
    else:
        limits = threadpool_limits(limits=threads, user_api="blas")
    try:
        with limits:
            yield
    finally:
        _threads.set_num_threads(before)


def cpu_sets(workers: int, threads: int) -> list[set[int] | None]:
    """The CPUs each worker is confined to: ``threads`` of its own where there are enough
    (attnlab's pools then pin threads inside those only), else no confinement (None).

    >>> cpu_sets(2, 1)
    [None, None]
    """
    if threads < 2:
        return [None] * workers  # one thread: attnlab's pools never start, nothing is pinned
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [None] * workers
    if len(allowed) < workers * threads:
        return [None] * workers
    return [set(allowed[w * threads:(w + 1) * threads]) for w in range(workers)]


class Job:
    """One batch on its way: its name, the batch, the driver's entries of its items (not
    sent to workers) and how many workers have died on it."""

    __slots__ = ("name", "batch", "entries", "deaths")

    def __init__(self, name: str, batch: Batch, entries: list):
        self.name, self.batch, self.entries, self.deaths = name, batch, entries, 0


# --------------------------------------------------------------------------- serial


class SerialEngine:
    """Every batch in this process, one after another."""

    def __init__(self, model, method: Method, *, threads: int, **_):
        self.model, self.method, self.threads = model, method, threads
        self.ready_at = None

    def __enter__(self):
        self.ready_at = time.perf_counter()
        return self

    def __exit__(self, *exc):
        return False

    def map(self, jobs: Iterator[Job]) -> Iterator[tuple[Job, Outcome]]:
        with compute_threads(self.threads):
            for job in jobs:
                yield job, run_batch(self.model, self.method, job.batch)


# --------------------------------------------------------------------------- processes


def _worker_main(conn, recipe, method, threads: int, cpus) -> None:
    """A worker process: confine, limit threads, build the model once, then compute batches
    until the driver sends None or goes away."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    try:
        with compute_threads(threads):
            model = recipe.build()
            conn.send(("ready", os.getpid()))
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the driver is gone
                    return
                if msg is None:
                    return
                name, batch = msg
                conn.send((name, run_batch(model, method, batch)))
    except (EOFError, OSError, BrokenPipeError):
        return
    except BaseException as exc:  # a model that cannot be built: say why, then stop
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("error", _error_text(exc)))
        raise SystemExit(1) from None


class ProcessEngine:
    """``workers`` local processes (see the module docstring)."""

    def __init__(self, model, method: Method, *, threads: int, workers: int, recipe, **_):
        self.method, self.threads, self.workers, self.recipe = method, threads, workers, recipe
        self.cpus = cpu_sets(workers, threads)
        self.procs: list = [None] * workers
        self.conns: list = [None] * workers
        self.ready_at = None

    def _start(self, w: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(theirs, self.recipe, self.method, self.threads, self.cpus[w]),
                           name=f"attnlab-sweep-{w}", daemon=True)
        proc.start()
        theirs.close()
        self.procs[w], self.conns[w] = proc, ours

    def __enter__(self):
        for w in range(self.workers):
            self._start(w)
        for w in range(self.workers):
            self._wait_ready(w)
        self.ready_at = time.perf_counter()
        return self

    def _wait_ready(self, w: int) -> None:
        conn, proc = self.conns[w], self.procs[w]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            proc.join(5)
            raise SweepError(f"a sweep worker died while loading the model (exit code {proc.exitcode}); in a "
                             "script, start the sweep under 'if __name__ == \"__main__\":' (workers are "
                             "started with multiprocessing's spawn, which imports the script)") from None
        if msg[0] != "ready":
            raise SweepError(f"a sweep worker could not build the model: {msg[1]}")

    def __exit__(self, *exc):
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError, AttributeError):
                conn.send(None)
        for proc in self.procs:
            if proc is None:
                continue
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            with contextlib.suppress(AttributeError, OSError):
                conn.close()
        return False

    def map(self, jobs: Iterator[Job]) -> Iterator[tuple[Job, Outcome]]:
        from multiprocessing.connection import wait

        retry: deque[Job] = deque()
        busy: dict[int, Job] = {}
        jobs = iter(jobs)
        exhausted = False

        def next_job() -> Job | None:
            nonlocal exhausted
            if retry:
                return retry.popleft()
            if exhausted:
                return None
            job = next(jobs, None)
            exhausted = job is None
            return job

        def feed(w: int) -> None:
            job = next_job()
            if job is None:
                return
            try:
                self.conns[w].send((job.name, job.batch))
            except (OSError, BrokenPipeError):  # died between batches: its death is handled below
                retry.appendleft(job)
                return
            busy[w] = job

        for w in range(self.workers):
            feed(w)
        while busy:
            ready = wait([self.conns[w] for w in busy] + [self.procs[w].sentinel for w in busy])
            for w in list(busy):
                conn, proc = self.conns[w], self.procs[w]
                got = None
                if conn in ready:
                    try:
                        got = conn.recv()
                    except (EOFError, OSError):
                        got = None
                if got is not None:
                    job = busy.pop(w)
                    feed(w)  # the next batch first, then the driver writes this one's results
                    yield job, got[1]
                elif proc.sentinel in ready or not proc.is_alive():
                    job = busy.pop(w)
                    proc.join(5)
                    code = proc.exitcode
                    job.deaths += 1
                    if job.deaths >= 2:
                        yield job, Outcome.failed(len(job.batch), f"the worker computing it died twice (exit code "
                                                                  f"{code})")
                    else:
                        retry.appendleft(job)
                    self._start(w)
                    self._wait_ready(w)
                    feed(w)


# --------------------------------------------------------------------------- ray


# How long the probe of a Ray address waits for an answer, connecting and replying together.
PROBE_SECONDS = 10.0

# A Ray cluster's address (its GCS, or a Ray Client server) speaks gRPC, that is HTTP/2: to a
# client's connection preface (RFC 9113, 3.4: the fixed 24 bytes, then a SETTINGS frame) the
# server's first frame is a SETTINGS frame on stream 0.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 0x4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 0x4


def probe(address: str, *, timeout: float = PROBE_SECONDS) -> None:
    """Raise ``SweepError`` unless a gRPC server (what a Ray cluster's address is) answers at
    ``address`` (``host:port`` or ``ray://host:port``; ``"auto"`` is left to Ray) within
    ``timeout`` seconds. Ray's own ``ray.init`` waits minutes on an address where nothing,
    or something else than Ray, listens; this answers in seconds. With ``RAY_USE_TLS`` set
    only the connection is checked (the handshake is TLS's).
    """
    import socket

    if address == "auto":
        return
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise SweepError(f"address must be host:port (or ray://host:port, or 'auto'), got {address!r}")
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except OSError as exc:  # refused, unreachable, a name that does not resolve, no answer in time
        raise SweepError(f"no Ray cluster answers at {address} ({exc.strerror or exc or 'timed out'}); start one "
                         "with 'ray start --head' or give the address it printed") from None
    reply = b""
    with sock:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return
        try:
            sock.sendall(_H2_PREFACE)
            while len(reply) < 9:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            raise SweepError(f"something listens at {address} but does not answer as a Ray cluster (no reply "
                             f"within {timeout:.0f} s); give the address 'ray start --head' printed") from None
        except OSError:  # reset: it took the connection, then dropped it
            pass
    if len(reply) < 9 or reply[3] != _H2_SETTINGS or reply[5:9] != bytes(4):
        got = f"it replied {reply[:24]!r}" if reply else "it closed the connection"
        raise SweepError(f"what listens at {address} is not a Ray cluster ({got}; a Ray address speaks gRPC); "
                         "give the address 'ray start --head' printed")


def _ray(local: bool = False):
    if local and "ray" not in sys.modules:
        # Ray then keeps a one-node cluster on the loopback address (read when ray is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as exc:
        raise ImportError("engine='ray' needs Ray: pip install 'attnlab[ray]'") from exc
    return ray


class _Actor:
    """A Ray actor: the model built once, then batch after batch."""

    def __init__(self, recipe, weights, method, threads: int):
        self.threads, self.method = threads, method
        recipe.arrays = weights  # Ray gives the put dict: read-only views of its object store
        with compute_threads(threads):
            self.model = recipe.build()

    def run(self, batch):
        with compute_threads(self.threads):
            return run_batch(self.model, self.method, batch)


class RayEngine:
    """One Ray actor per worker (see the module docstring)."""

    def __init__(self, model, method: Method, *, threads: int, workers: int, recipe, address: str | None = None,
                 **_):
        self.model, self.method, self.threads, self.workers = model, method, threads, workers
        self.recipe, self.address = recipe, address
        self.started = False
        self.actors: list = []
        self.ready_at = None

    def __enter__(self):
        ray = _ray(local=self.address is None)
        if self.address is not None:  # probed by sweep() before anything was loaded
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                raise SweepError(f"the Ray cluster at {self.address} refused the connection ({exc}); a cluster "
                                 "with token authentication needs RAY_AUTH_MODE=token and its token") from None
            self.started = True  # this process's connection: dropped at the end (the cluster stays)
        elif not ray.is_initialized():
            ray.init(address="local", num_cpus=self.workers * self.threads, include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
            self.started = True
        try:
            arrays = {name: p.data for name, p in self.model.named_parameters()}
            self.weights = ray.put(arrays)
            self.actor_class = ray.remote(num_cpus=self.threads, max_restarts=0)(_Actor)
            self.actors = [self._new_actor() for _ in range(self.workers)]
            ray.get([a.__ray_ready__.remote() for a in self.actors])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.ready_at = time.perf_counter()
        return self

    def _new_actor(self):
        return self.actor_class.remote(self.recipe, self.weights, self.method, self.threads)

    def __exit__(self, *exc):
        ray = _ray()
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        if self.started:
            ray.shutdown()
        return False

    def map(self, jobs: Iterator[Job]) -> Iterator[tuple[Job, Outcome]]:
        ray = _ray()
        from ray.exceptions import ActorDiedError, RayActorError

        retry: deque[Job] = deque()
        busy: dict = {}  # ObjectRef -> (worker, job)
        jobs = iter(jobs)
        exhausted = False

        def feed(w: int) -> None:
            nonlocal exhausted
            job = retry.popleft() if retry else None
            if job is None and not exhausted:
                job = next(jobs, None)
                exhausted = job is None
            if job is not None:
                busy[self.actors[w].run.remote(job.batch)] = (w, job)

        for w in range(self.workers):
            feed(w)
        while busy:
            done, _ = ray.wait(list(busy), num_returns=1)
            ref = done[0]
            w, job = busy.pop(ref)
            try:
                outcome = ray.get(ref)
            except (RayActorError, ActorDiedError) as exc:
                job.deaths += 1
                with contextlib.suppress(Exception):
                    ray.kill(self.actors[w])
                self.actors[w] = self._new_actor()
                if job.deaths >= 2:
                    feed(w)
                    error = f"the actor computing it died twice ({type(exc).__name__})"
                    yield job, Outcome.failed(len(job.batch), error)
                else:
                    retry.appendleft(job)
                    feed(w)
                continue
            feed(w)
            yield job, outcome
