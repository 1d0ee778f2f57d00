"""Run a method over a dataset and write its results as it goes: :func:`sweep`, read back
with :func:`read_results`.

>>> import tempfile, numpy as np
>>> from attnlab.models import GPT2, GPT2Config
>>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
...              rng=np.random.default_rng(0))
>>> prompts = [{"text": [1, 2, 3, 4]}, {"text": [5, 6]}, {"text": [7, 8, 9]}]
>>> with tempfile.TemporaryDirectory() as out:
...     report = sweep(model, prompts, out, method="cache",
...                    options={"hooks": ["blocks.1.hook_resid_post"], "position": -1})
...     again = sweep(model, prompts, out, method="cache",          # resumes: nothing left to do
...                   options={"hooks": ["blocks.1.hook_resid_post"], "position": -1})
...     results = read_results(out)
>>> report.computed, again.computed, again.skipped
(3, 0, 3)
>>> results["blocks.1.hook_resid_post"].shape     # (items, D): the last token of each
(3, 16)

The folder's layout is described in :mod:`attnlab.sweep._store`; the engines in
:mod:`attnlab.sweep.engines`; the methods in :mod:`attnlab.sweep.methods`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from attnlab._validation import positive_int
from attnlab.sweep import engines as _engines
from attnlab.sweep._data import Plan, count, describe, encode, make_batch, read_entries, windows
from attnlab.sweep._model import adopt, load_model, map_weights, model_identity, recipe_for, write_weights
from attnlab.sweep._store import Store, SweepError, SweepResults, read_results
from attnlab.sweep.engines import ENGINES, Job
from attnlab.sweep.methods import (
    METHODS,
    Batch,
    FunctionMethod,
    Method,
    make_method,
    register_method,
)

__all__ = [
    "ENGINES",
    "METHODS",
    "Batch",
    "FunctionMethod",
    "Method",
    "Progress",
    "SweepError",
    "SweepReport",
    "SweepResults",
    "read_results",
    "register_method",
    "sweep",
]


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a running sweep stands (what the ``progress`` callback receives after each batch).

    Attributes:
        done: items recorded so far (this run and earlier ones, failed ones included).
        total: items in the dataset, where known (a file, a sized iterable), else None.
        computed: items this run has computed.
        failed: items recorded as failed (this run and earlier ones).
        elapsed: seconds since the workers were ready (model loading not counted).
        rate: items per second this run computes (``computed / elapsed``).
        eta: seconds left at that rate, where ``total`` is known.
    """

    done: int
    total: int | None
    computed: int
    failed: int
    elapsed: float
    rate: float
    eta: float | None


@dataclasses.dataclass(frozen=True)
class SweepReport:
    """What :func:`sweep` returns.

    Attributes:
        out: the sweep's folder.
        run: this run's number (1 for the first; a resumed sweep counts on).
        computed: items computed in this run (failed ones included).
        skipped: items already recorded by an earlier run.
        failed: items recorded as failed, in every run.
        total: items in the dataset.
        load_seconds: until every worker had the model.
        seconds: from then to the end.
        rate: ``computed / seconds``.
    """

    out: Path
    run: int
    computed: int
    skipped: int
    failed: int
    total: int
    load_seconds: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0


def sweep(
    model,
    data: str | os.PathLike | Iterable,
    out: str | os.PathLike,
    *,
    method: str | Method | Callable = "logit_lens_top",
    options: Mapping[str, Any] | None = None,
    engine: str = "serial",
    workers: int | None = None,
    threads: int = 1,
    batch_size: int = 16,
    max_batch_tokens: int = 1024,
    window: int = 4096,
    on_error: str = "record",
    retry_failed: bool = False,
    address: str | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> SweepReport:
    """Run ``method`` over every item of ``data`` and write the results to ``out`` as it goes.

    Items are read in windows, sorted by length inside each window and cut into batches
    (left-padded); each batch's results go to one shard of ``out``, written atomically.
    Run it again on the same folder and it goes on where it stopped (killed, interrupted,
    out of disk): recorded items are skipped and nothing is written twice. An item that
    cannot be read or computed is recorded with its error (its line number for a JSONL
    file) and the sweep goes on.

    Args:
        model: an attnlab model, ``"smollm2"`` (the bundled SmolLM2-135M-Instruct) or a
            model path (a folder, a ``.gguf`` file, an attnlab checkpoint).
        data: a JSONL file (one JSON object a line; a JSON string is taken as the text) or
            an iterable of items (dicts, texts or lists of token ids).
        out: the sweep's folder (created; a folder of another sweep's settings is refused).
        method: a name in :data:`METHODS` (``"cache"``, ``"logit_lens_top"``,
            ``"detect_heads"``, ``"activation_patching"``, ``"generate"``), a
            :class:`Method`, or a function ``(model, batch) -> dict of arrays``.
        options: the method's options (e.g. ``{"hooks": [...], "position": -1}`` for
            ``"cache"``, ``{"k": 5}`` for ``"logit_lens_top"``, ``{"field": "prompt"}``).
        engine: ``"serial"``, ``"processes"`` or ``"ray"``: the same results, bit for bit (but for
            the first run after the compiled kernels are built: see the how-to's "Engines").
        workers: worker processes or actors (default: the usable CPUs divided by ``threads``).
        threads: threads each batch computes with (BLAS and attnlab's pools), in every engine.
        batch_size: most items in a batch.
        max_batch_tokens: most padded tokens in a batch (items times the longest length).
        window: items read, sorted by length and cut into batches at a time.
        on_error: ``"record"`` (an item's error is recorded and the sweep goes on) or
            ``"raise"`` (the sweep stops with a :class:`SweepError` after recording it).
        retry_failed: run the items an earlier run recorded as failed again.
        address: with ``engine="ray"``, a running cluster's address (``host:port``); None
            starts a local one-node cluster for the sweep.
        progress: called with a :class:`Progress` after each batch.

    Returns:
        A :class:`SweepReport`.

    Raises:
        SweepError: ``out`` holds another sweep (its differing settings are named), another
            sweep is running in ``out``, the dataset changed since the folder was begun, the
            disk is full (what was written stays intact; nothing is half-written), a Ray
            address where no Ray cluster answers (within 10 s), ``on_error="raise"`` and an
            item failed.
        ValueError, TypeError: unknown methods, engines or options.
        ImportError: pyarrow (the ``sweep`` extra) or, for ``engine="ray"``, Ray is missing.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    if importlib.util.find_spec("pyarrow") is None:
        raise ImportError("a sweep writes its items table as Parquet through pyarrow: pip install 'attnlab[sweep]'")
    if on_error not in ("record", "raise"):
        raise ValueError(f"on_error must be 'record' or 'raise', got {on_error!r}")
    if address is not None and engine != "ray":
        raise ValueError(f"address= is for engine='ray', not {engine!r}")
    threads = positive_int(threads, "threads")
    plan = Plan(positive_int(batch_size, "batch_size"), positive_int(max_batch_tokens, "max_batch_tokens"),
                positive_int(window, "window"))
    if workers is None:
        workers = max(1, len(os.sched_getaffinity(0)) // threads) if hasattr(os, "sched_getaffinity") else 1
    workers = positive_int(workers, "workers")
    if engine == "ray" and address is not None:
        _engines.probe(address)  # before anything is loaded or written: seconds, not Ray's minutes
    method = make_method(method, options)
    given = model
    model = load_model(model)
    method.check(model)
    recipe = None if engine == "serial" else recipe_for(model)  # a model its class cannot rebuild: refused here
    settings = {"method": method.name, "options": method.settings(), "model": model_identity(model),
                "data": describe(data), "batching": dataclasses.asdict(plan), "threads": threads}
    total = count(data)
    t0 = time.perf_counter()
    with Store(out, settings, run_info={"engine": engine, "workers": 1 if engine == "serial" else workers,
                                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) as store, \
            contextlib.ExitStack() as cleanup:
        if engine == "processes":
            folder = cleanup.enter_context(store.worker_weights())
            recipe.path = str(_write_shared_weights(model, folder, store))
            if given is not model:  # loaded here: the driver maps the shared file too, its own copy freed
                adopt(model, map_weights(recipe.path, recipe.quantized))
        return _run(store, model, method, data, plan, engine, threads, workers, recipe, address, retry_failed,
                    on_error, total, progress, t0)


def _write_shared_weights(model, folder, store: Store):
    """The model's weights written once for the workers to map (``SweepError`` if the disk
    cannot take them: the items recorded so far are intact)."""
    try:
        return write_weights(model, folder)
    except OSError as exc:
        size = sum(p.data.nbytes for p in model.parameters()) / 2**20
        raise SweepError(f"could not write the workers' copy of the weights ({size:.1f} MiB) to {folder} "
                         f"({exc.strerror or exc}); the {len(store.records)} items recorded before are intact: "
                         "free space and run the sweep again, or use engine='serial'") from None


def _run(store, model, method, data, plan, engine, threads, workers, recipe, address, retry_failed, on_error,
         total, progress, t0) -> SweepReport:
    counts = {"computed": 0, "skipped": 0}
    runner = {"serial": _engines.SerialEngine, "processes": _engines.ProcessEngine, "ray": _engines.RayEngine}[engine]
    with runner(model, method, threads=threads, workers=workers, recipe=recipe, address=address) as pool:
        ready = pool.ready_at
        jobs = _jobs(store, data, method, model, plan, retry_failed, counts, on_error)
        for job, outcome in pool.map(jobs):
            _record(store, job, outcome, on_error)
            counts["computed"] += len(job.batch)
            store.write_table(every=10.0)
            if progress is not None:
                elapsed = time.perf_counter() - ready
                done = len(store.records)
                rate = counts["computed"] / elapsed if elapsed > 0 else 0.0
                eta = (total - done) / rate if total is not None and rate > 0 else None
                failed = sum(1 for r in store.records.values() if r["status"] == "failed")
                progress(Progress(done, total, counts["computed"], failed, elapsed, rate, eta))
    end = time.perf_counter()
    store.write_table()
    failed = sum(1 for r in store.records.values() if r["status"] == "failed")
    return SweepReport(store.out, store.run, counts["computed"], counts["skipped"], failed,
                       len(store.records) if total is None else total, ready - t0, end - ready)


def _record(store: Store, job: Job, outcome, on_error: str) -> None:
    """The batch's shard: one record per item, its results where it has them."""
    batch = job.batch
    records, results = [], {}
    for b, index in enumerate(batch.indices.tolist()):
        entry = job.entries[b]
        rec = {"index": index, "line": entry.line, "digest": entry.digest, "tokens": int(batch.lengths[b]),
               "status": "ok" if outcome.errors[b] is None else "failed", "error": outcome.errors[b]}
        if outcome.alone[b]:
            rec["alone"] = True
        records.append(rec)
        if outcome.results[b] is not None:
            results[index] = outcome.results[b]
    store.write(job.name, records, results)
    if on_error == "raise":
        bad = next((r for r in records if r["status"] == "failed"), None)
        if bad is not None:
            raise SweepError(f"item {bad['index']}" + (f" (line {bad['line']})" if bad["line"] else "")
                             + f" failed: {bad['error']}")


def _jobs(store: Store, data, method: Method, model, plan: Plan, retry_failed: bool, counts: dict,
          on_error: str) -> Iterator[Job]:
    """The batches still to compute, window after window; unreadable items are recorded as
    they are met (one shard per window). Decoders' batches are left-padded, encoders' right."""
    left = hasattr(model, "generate")
    for w, entries in enumerate(windows(read_entries(data, method.field), plan.window)):
        pending = []
        for e in entries:
            state = store.status(e.index, e.digest, e.where())
            if state == "ok" or (state == "failed" and not retry_failed):
                counts["skipped"] += 1
            else:
                pending.append(e.index)
        if not pending:
            continue
        todo = set(pending)
        unread = []
        for e in entries:
            encode(e, method, model)
            if e.error is not None and e.index in todo:
                unread.append({"index": e.index, "line": e.line, "digest": e.digest, "tokens": None,
                               "status": "failed", "error": e.error})
        if unread:
            store.write(f"{w:05d}-unread", unread, {})
            counts["computed"] += len(unread)
            if on_error == "raise":
                raise SweepError(unread[0]["error"])
        batches = plan.batches(entries, method.one_per_batch)
        for rank in reversed(range(len(batches))):  # the longest first: the workers end together
            members = [e for e in batches[rank] if e.index in todo]
            if not members:
                continue
            yield Job(f"{w:05d}-{rank:05d}", make_batch(members, batches[rank][0].index, left), members)
