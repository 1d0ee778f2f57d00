"""A sweep's folder: safetensors shards that record themselves, a manifest, and a Parquet table.

``OUT/manifest.json``
    the format, the settings (method and options, model, dataset, batching, threads) and
    one entry per run. A sweep that finds other settings there refuses to start.
``OUT/shards/<batch>.<run>.safetensors``
    one per batch, written atomically (a temporary file renamed into place): item ``i``'s
    result ``name`` is the tensor ``"i/name"``; the header's metadata lists every item of
    the batch with its status (``ok`` or ``failed`` and the error), its line and the digest
    of its raw text. The shards are the record of what is done: a sweep killed at any point
    restarts from them, and a batch is in a shard whole or not at all.
``OUT/items.parquet``
    one row per item (index, line, status, error, tokens, shard), rewritten from the shards
    every 10 seconds and at the end; a convenience for tables (pandas, DuckDB).
``OUT/.lock``
    held (``flock``) by the sweep running in the folder, so that a second one started on it
    is refused; the operating system lets go of it when that process ends, killed or not.
``OUT/worker-weights/``
    the ``processes`` engine's copy of the model's weights, which its workers map; removed
    at the end of the run, and at the start of the next one where a killed run left it.

Texts (``str`` results) are stored as their UTF-8 bytes (uint8) and read back as ``str``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write

__all__ = ["FORMAT", "SweepError", "SweepResults", "Store", "read_results"]

FORMAT = "attnlab-sweep/1"
_META_KEY = "attnlab.sweep"
LOCK = ".lock"
WORKER_WEIGHTS = "worker-weights"
_SHARD = re.compile(r"^(?P<batch>[0-9a-z-]+)\.(?P<run>\d+)\.safetensors$")


class SweepError(Exception):
    """A sweep that cannot start or go on (other settings in its folder, a full disk, a Ray
    cluster that does not answer, a changed dataset); the message says what to do."""


def _write_json(path: Path, data) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n"))


class Store:
    """The writer of one sweep's folder (the driver's; workers write nothing).

    Opening checks the manifest against ``settings`` (a folder of another sweep is refused,
    its differing settings named) and reads what the shards hold.
    """

    def __init__(self, out: str | os.PathLike, settings: dict, *, run_info: dict):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise SweepError(f"{self.out} is a file, not a folder for the sweep's results")
        self.shards = self.out / "shards"
        manifest_path = self.out / "manifest.json"
        settings = json.loads(json.dumps(settings))  # as JSON will give it back
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise SweepError(f"{manifest_path} is unreadable ({exc}): not a sweep's folder, or damaged") from None
            if manifest.get("format") != FORMAT:
                raise SweepError(f"{self.out} holds a sweep of format {manifest.get('format')!r}, not {FORMAT!r}")
            _same_settings(self.out, manifest.get("settings", {}), settings)
        else:
            if self.out.is_dir() and any(p.name not in (".DS_Store", LOCK) for p in self.out.iterdir()):
                raise SweepError(f"{self.out} is not empty and holds no sweep (no manifest.json): give a new or "
                                 "empty folder")
            manifest = {"format": FORMAT, "settings": settings, "runs": []}
        self.records = load_records(self.out)
        self.run = 1 + max((r["run"] for r in manifest["runs"]), default=0)
        manifest["runs"].append({"run": self.run, **run_info})
        self._lock = None
        self._begin(manifest_path, manifest, new=not manifest_path.is_file())
        self.manifest = manifest
        self._table_written = -math.inf

    def _begin(self, manifest_path: Path, manifest: dict, *, new: bool) -> None:
        """Create the folder, take its lock and write the manifest; on a failure (a full
        disk, no permission) remove what this made and raise ``SweepError``."""
        made = [p for p in (*reversed(self.out.parents), self.out, self.shards) if not p.exists()]
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock = _take_lock(self.out)
            self.shards.mkdir(exist_ok=True)
            _write_json(manifest_path, manifest)  # last: a folder with a manifest is a sweep's
        except OSError as exc:
            self.close()
            if new:
                with contextlib.suppress(OSError):
                    (self.out / LOCK).unlink(missing_ok=True)
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: nothing of anyone else's goes
            where = "nothing was written" if new else f"{self.out} is as it was"
            raise SweepError(f"could not begin the sweep in {self.out} ({exc.strerror or exc}); {where}: free "
                             "space (or give a folder that can be written) and run it again") from None
        stale = self.out / WORKER_WEIGHTS
        if self._lock is not None and stale.exists():  # a killed run's: the lock says no other runs here
            shutil.rmtree(stale, ignore_errors=True)

    @contextlib.contextmanager
    def worker_weights(self):
        """The folder ``OUT/worker-weights`` for the workers' copy of the weights, removed
        when the block ends (and, where a killed run left it, when the next run begins)."""
        folder = self.out / WORKER_WEIGHTS
        try:
            folder.mkdir(exist_ok=True)
        except OSError as exc:
            raise SweepError(f"could not create {folder} ({exc.strerror or exc}); the {len(self.records)} items "
                             "recorded before are intact: free space and run the sweep again") from None
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Let go of the folder's lock (the sweep is over)."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                self._lock.close()
            self._lock = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def status(self, index: int, digest: str, where: str) -> str | None:
        """``"ok"``/``"failed"`` when item ``index`` is recorded, else None.

        Raises:
            SweepError: the recorded item had other contents (the dataset changed).
        """
        rec = self.records.get(index)
        if rec is None:
            return None
        if rec["digest"] != digest:
            raise SweepError(f"the dataset changed since this sweep began: {where} differs from what "
                             f"{self.out} recorded for it; give a new folder for a new dataset")
        return rec["status"]

    def write(self, batch_name: str, records: list[dict], results: Mapping[int, Mapping[str, object]]) -> Path:
        """One shard: ``records`` (one per item) and ``results`` (index -> name -> array or
        str), atomically. Raises ``SweepError`` when the disk is full, the shard not written."""
        from attnlab.io.safetensors import save_tensors

        tensors, kinds = {}, {}
        for index, named in results.items():
            for name, value in named.items():
                if isinstance(value, str):
                    kinds[name] = "str"
                    value = np.frombuffer(value.encode("utf-8"), dtype=np.uint8)
                tensors[f"{index}/{name}"] = np.asarray(value, order="C")  # 0-d stays 0-d
        path = self.shards / f"{batch_name}.{self.run}.safetensors"
        meta = {"batch": batch_name, "run": self.run, "items": records, "kinds": kinds}
        try:
            save_tensors(path, tensors, metadata={_META_KEY: json.dumps(meta)})
        except OSError as exc:
            done = sum(1 for r in self.records.values())
            raise SweepError(f"could not write {path.name} ({exc.strerror or exc}); the {done} items recorded "
                             f"before it are intact in {self.out}: free space and run the sweep again to go on") \
                from exc
        for rec in records:
            self.records[rec["index"]] = {**rec, "shard": path.name, "run": self.run}
        return path

    def write_table(self, *, every: float = 0.0) -> None:
        """``items.parquet`` from the records, unless it was written less than ``every``
        seconds ago (best effort: the shards are the record)."""
        now = time.monotonic()
        if now - self._table_written < every:
            return
        with contextlib.suppress(OSError):
            write_items_table(self.out / "items.parquet", self.records)
        self._table_written = now


def _take_lock(out: Path):
    """The open lock file of ``out``, locked (None where the file system has no locks);
    ``SweepError`` while another sweep holds it."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one sweep per folder is the user's to keep
        return None
    fh = open(out / LOCK, "a+")  # noqa: SIM115 (held open for the run: the lock lives with it)
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise SweepError(f"another sweep is running in {out}: wait for it to end, or give another folder") from None
    except OSError:  # a file system without locks (some network ones): the sweep runs unguarded
        fh.close()
        return None
    return fh


def _same_settings(out: Path, theirs: dict, ours: dict) -> None:
    if theirs == ours:
        return
    diffs = []
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            a, b = json.dumps(theirs.get(key), sort_keys=True), json.dumps(ours.get(key), sort_keys=True)
            diffs.append(f"{key}: {a[:120]} there, {b[:120]} here")
    raise SweepError(f"{out} holds a sweep with other settings ({'; '.join(diffs)}); give another folder, or "
                     "delete it to start over")


def _shard_files(out: Path) -> list[Path]:
    folder = out / "shards"
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if _SHARD.match(p.name)]
    return sorted(files, key=lambda p: (int(_SHARD.match(p.name)["run"]), p.name))


def _shard_meta(path: Path) -> tuple[dict, dict]:
    from attnlab.io.safetensors import read_header

    infos, metadata = read_header(path)
    try:
        meta = json.loads(metadata[_META_KEY])
    except (KeyError, json.JSONDecodeError):
        raise SweepError(f"{path} is not a sweep's shard (no {_META_KEY!r} metadata)") from None
    return infos, meta


def load_records(out: Path) -> dict[int, dict]:
    """index -> the latest record of that item over every shard (later runs win)."""
    records: dict[int, dict] = {}
    for path in _shard_files(out):
        _, meta = _shard_meta(path)
        for rec in meta["items"]:
            records[int(rec["index"])] = {**rec, "shard": path.name, "run": meta["run"]}
    return records


def write_items_table(path: Path, records: Mapping[int, dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [records[i] for i in sorted(records)]
    table = pa.table({
        "index": pa.array([r["index"] for r in rows], pa.int64()),
        "line": pa.array([r.get("line") for r in rows], pa.int64()),
        "status": pa.array([r["status"] for r in rows], pa.string()),
        "error": pa.array([r.get("error") for r in rows], pa.string()),
        "tokens": pa.array([r.get("tokens") for r in rows], pa.int64()),
        "shard": pa.array([r.get("shard") for r in rows], pa.string()),
    })
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def split_results(out: object, batch_size: int) -> list[dict[str, object]]:
    """A method's ``{name: (B, ...) array or list of B}`` as one ``{name: value}`` per item.

    Raises:
        TypeError: not a dict of arrays, or values that are not one per item.
    """
    if not isinstance(out, Mapping):
        raise TypeError(f"a method returns a dict of arrays (one row per item), got {type(out).__name__}")
    per_item: list[dict[str, object]] = [{} for _ in range(batch_size)]
    for name, value in out.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:\-]+", name):
            raise TypeError(f"result names are str of letters, digits, '_', '.', ':' and '-', got {name!r}")
        rows = value if isinstance(value, list | tuple) else np.asarray(value)
        if len(rows) != batch_size:
            raise TypeError(f"result {name!r} has {len(rows)} rows for a batch of {batch_size} items")
        for b in range(batch_size):
            v = rows[b]
            per_item[b][name] = v if isinstance(v, str) else np.asarray(v)
    return per_item


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass
class SweepResults:
    """What :func:`read_results` returns: one array per result, items in dataset order.

    Attributes:
        arrays: result name -> ``(n, ...)`` array; item ``i`` is row ``i``. Where items'
            shapes differ (one row per token), each axis takes the largest size and the
            rest is filled at the end (NaN for floats, -1 for ints, False, ``""``);
            :attr:`shapes` gives every item's own shape. Items without the result (failed,
            not yet run) are filled whole.
        shapes: result name -> ``(n, ndim)`` int64: each item's own shape (-1 where it has none).
        status: ``(n,)`` ``"ok"``, ``"failed"`` or ``"missing"`` (not run yet).
        errors: index -> the error of a failed item.
        lines: ``(n,)`` each item's line in the JSONL file (-1 for an iterable).
        tokens: ``(n,)`` each item's length in tokens (-1 where unknown).
        settings: the sweep's settings (method, options, model, batching).
    """

    arrays: dict[str, np.ndarray]
    shapes: dict[str, np.ndarray]
    status: np.ndarray
    errors: dict[int, str]
    lines: np.ndarray
    tokens: np.ndarray
    settings: dict

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise KeyError(f"no result {name!r}; this sweep has {', '.join(self.arrays) or 'none'}") from None

    def keys(self):
        return self.arrays.keys()

    @property
    def ok(self) -> np.ndarray:
        """``(n,)`` bool: the items whose results are there."""
        return self.status == "ok"

    def item(self, index: int) -> dict[str, object]:
        """Item ``index``'s results at their own shapes (no fill)."""
        if self.status[index] != "ok":
            return {}
        return {name: a[(index, *(slice(0, s) for s in self.shapes[name][index]))] if a.dtype != object
                else a[index] for name, a in self.arrays.items()}


def _fill(dtype: np.dtype):
    if dtype.kind == "f" or dtype.kind == "c":
        return np.nan
    if dtype.kind in "iu":
        return -1 if dtype.kind == "i" else 0
    if dtype.kind == "b":
        return False
    return ""


def read_results(out: str | os.PathLike) -> SweepResults:
    """Read a sweep's folder back: one array per result, in dataset order (see
    :class:`SweepResults`). Works on a sweep that is still running or was stopped: it
    reads what the shards hold.

    Raises:
        SweepError: ``out`` is not a sweep's folder.

    >>> import tempfile, numpy as np
    >>> from attnlab.models import GPT2, GPT2Config
    >>> from attnlab.sweep import sweep
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> with tempfile.TemporaryDirectory() as out:
    ...     _ = sweep(model, [[1, 2, 3], [4, 5]], out, method="logit_lens_top", options={"k": 2})
    ...     results = read_results(out)
    >>> results["ids"].shape, results.shapes["ids"].tolist(), results.status.tolist()
    ((2, 3, 3, 2), [[3, 3, 2], [3, 2, 2]], ['ok', 'ok'])
    """
    out = Path(out)
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        raise SweepError(f"{out} is not a sweep's folder (no manifest.json)")
    settings = json.loads(manifest_path.read_text()).get("settings", {})
    from attnlab.io.safetensors import load_tensors

    latest: dict[int, tuple[dict, Path]] = {}
    metas: dict[Path, tuple] = {}
    for path in _shard_files(out):
        infos, meta = _shard_meta(path)
        metas[path] = (infos, meta)
        for rec in meta["items"]:
            latest[int(rec["index"])] = (rec, path)
    n = 1 + max(latest, default=-1)
    status = np.full(n, "missing", dtype=object)
    lines, tokens = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    errors: dict[int, str] = {}
    values: dict[str, dict[int, object]] = {}
    kinds: dict[str, str] = {}
    by_shard: dict[Path, list[int]] = {}
    for index, (rec, path) in latest.items():
        status[index] = rec["status"]
        lines[index] = rec.get("line") if rec.get("line") is not None else -1
        tokens[index] = rec.get("tokens") if rec.get("tokens") is not None else -1
        if rec["status"] == "failed":
            errors[index] = rec.get("error") or ""
        else:
            by_shard.setdefault(path, []).append(index)
    for path, indices in by_shard.items():
        infos, meta = metas[path]
        kinds.update(meta.get("kinds", {}))
        keep = set(indices)
        wanted = [name for name in infos if int(name.split("/", 1)[0]) in keep]
        for name, arr in load_tensors(path, wanted, header=(infos, {}), finite=False).items():
            index, result = name.split("/", 1)
            values.setdefault(result, {})[int(index)] = arr
    arrays, shapes = {}, {}
    for name, per_item in values.items():
        if kinds.get(name) == "str":
            a = np.full(n, "", dtype=object)
            for i, v in per_item.items():
                a[i] = v.tobytes().decode("utf-8")
            arrays[name] = a
            shapes[name] = np.zeros((n, 0), dtype=np.int64)
            continue
        ndim = max(v.ndim for v in per_item.values())
        dtype = np.result_type(*per_item.values())
        size = [max((v.shape[d] if v.ndim > d else 0) for v in per_item.values()) for d in range(ndim)]
        a = np.full((n, *size), _fill(dtype), dtype=dtype)
        sh = np.full((n, ndim), -1, dtype=np.int64)
        for i, v in per_item.items():
            a[(i, *(slice(0, s) for s in v.shape))] = v
            sh[i, : v.ndim] = v.shape
        arrays[name], shapes[name] = a, sh
    status = status.astype(str) if n else np.array([], dtype=str)
    return SweepResults(arrays, shapes, status, errors, lines, tokens, settings)

