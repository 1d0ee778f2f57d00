"""The safetensors format, read and written with NumPy alone (no pickle, no torch).

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and
the tensors' bytes. :func:`read_header` validates the whole header before anything is
allocated: known dtypes, shapes that are lists of non-negative ints, offsets inside the
file that match ``prod(shape) * itemsize`` and do not overlap. Every error is a
:class:`~attnlab.io.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write
from attnlab.io.checks import MAX_WEIGHT, check_weights
from attnlab.io.files import CheckpointError, read_json, regular_file

__all__ = ["DTYPES", "FLOAT_DTYPES", "TensorInfo", "folder_headers", "load_folder", "load_tensors", "read_header",
           "save_tensors"]

# safetensors dtype tag -> NumPy dtype of the stored bytes (little-endian). BF16 is stored
# as its 16 bits and widened to float32 on reading.
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# The header is JSON of a few hundred bytes per tensor; more than this is refused unread.
MAX_HEADER_BYTES = 8 << 20
# The largest dimension NumPy can hold (an array of shape [0, 2**63] is refused by NumPy).
MAX_DIM = np.iinfo(np.intp).max


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: its dtype tag, shape and byte range ``[begin, end)`` in
    the file (from its start)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict]:
    """``({name: TensorInfo}, metadata)`` of a ``.safetensors`` file, fully validated.

    Only the header is read: nothing is allocated for the tensors.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: not a safetensors file, a malformed entry, or a tensor that lies
            outside the file (the message names the file and the tensor).
    """
    path = regular_file(path, "safetensors file")
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: only {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{path} is not a safetensors file: its header claims {n} bytes, the file has {size}"
            )
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: the header is {n} bytes, more than the {MAX_HEADER_BYTES} "
                                  "attnlab reads")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, a 5000-digit number
        raise CheckpointError(f"{path} is not a safetensors file: unreadable header ({type(exc).__name__})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ should be a JSON object")
    data_size = size - 8 - n
    infos = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: tensor {name!r} should have exactly dtype, shape and "
                                  f"data_offsets, got {entry!r:.100}")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {tag!r:.20}")
        if not isinstance(shape, list) or not all(_int(s) and 0 <= s <= MAX_DIM for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r:.100}, but a shape "
                                  f"should be a list of non-negative ints (at most {MAX_DIM})")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {offsets!r:.100}, but "
                                  "they should be two ints [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies outside the file (truncated or corrupt file)"
            )
        nbytes = math.prod(shape) * DTYPES[tag].itemsize
        if end - begin != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} of shape {tuple(shape)} and dtype {tag} needs {nbytes} "
                f"bytes, but its data_offsets span {end - begin}"
            )
        infos[name] = TensorInfo(tag, tuple(shape), 8 + n + begin, 8 + n + end)
    spans = sorted((i.begin, i.end, name) for name, i in infos.items() if i.end > i.begin)
    for (_, end0, a), (begin1, _, b) in zip(spans, spans[1:], strict=False):
        if begin1 < end0:
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} overlap (corrupt file)")
    return infos, metadata


def load_tensors(
    path: str | os.PathLike,
    names: Iterable[str] | None = None,
    *,
    dtype=None,
    header: tuple[dict[str, TensorInfo], dict] | None = None,
    finite: bool = True,
    max_abs: float = math.inf,
) -> dict[str, np.ndarray]:
    """Read tensors from a ``.safetensors`` file.

    Args:
        path: the file.
        names: the tensors to read (default: all).
        dtype: cast every tensor to this dtype (default: keep; BF16 becomes float32).
        header: the file's :func:`read_header` result, if already read.
        finite: refuse a float tensor holding NaN or inf.
        max_abs: with ``finite``, refuse a float tensor holding a value beyond ``±max_abs``
            (the model loaders pass :data:`~attnlab.io.checks.MAX_WEIGHT`).

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: see :func:`read_header`; a missing tensor; NaN, inf or (``max_abs``) huge weights.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = save_tensors(Path(d) / "w.safetensors", {"w": np.eye(2, dtype=np.float32)})
    ...     load_tensors(p)["w"]
    array([[1., 0.],
           [0., 1.]], dtype=float32)
    """
    path = Path(path)
    infos, _ = read_header(path) if header is None else header
    names = list(infos) if names is None else list(names)
    missing = [n for n in names if n not in infos]
    if missing:
        raise CheckpointError(f"{path}: no tensor {missing[0]!r}")
    out = {}
    with path.open("rb") as fh:
        for name in names:
            info = infos[name]
            raw = np.empty(info.shape, dtype=DTYPES[info.dtype])
            fh.seek(info.begin)
            if fh.readinto(memoryview(raw.reshape(-1)).cast("B")) != info.end - info.begin:
                raise CheckpointError(f"{path}: tensor {name!r} could not be read whole (truncated file)")
            arr = (raw.astype(np.uint32) << 16).view(np.float32) if info.dtype == "BF16" else raw
            if not arr.dtype.isnative:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            if dtype is not None:
                arr = arr.astype(dtype, copy=False)
            if finite:
                check_weights(arr, repr(name), path, limit=max_abs)
            out[name] = arr
    return out


def folder_headers(folder: str | os.PathLike) -> dict[Path, tuple[dict[str, TensorInfo], dict]]:
    """The checked header (:func:`read_header`) of a model folder's ``model.safetensors``, or
    of every shard its ``model.safetensors.index.json`` lists, by file; no tensor is read.

    Raises:
        FileNotFoundError: neither file is there.
        CheckpointError: a folder with only ``pytorch_model.bin`` (a pickle file, never
            read), an index without a ``weight_map`` or naming a file outside the folder, a
            malformed header, a tensor in two shards.
    """
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        names = sorted({str(n) for n in weight_map.values()})
        for n in names:
            if "/" in n or "\\" in n or n.startswith(".") or not n:
                raise CheckpointError(f"{index}: shard name {n!r:.100} is not a file in the folder")
        files = [folder / n for n in names]
    elif (folder / "pytorch_model.bin").is_file():
        raise CheckpointError(f"{folder} has only pytorch_model.bin (a pickle file, never loaded by attnlab); "
                              "convert it to model.safetensors")
    else:
        raise FileNotFoundError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")
    headers = {f: read_header(f) for f in files}
    seen: dict[str, Path] = {}
    for f, (infos, _) in headers.items():
        for name in infos:
            if name in seen:
                raise CheckpointError(f"{folder}: tensor {name!r} is in both {seen[name].name} and {f.name}")
            seen[name] = f
    return headers


def load_folder(headers: Mapping[Path, tuple[dict[str, TensorInfo], dict]], names: Iterable[str], *,
                dtype=None) -> dict[str, np.ndarray]:
    """The weights ``names`` from the files of :func:`folder_headers` (each read from the
    file that holds it; see :func:`load_tensors`), finite and within
    :data:`~attnlab.io.checks.MAX_WEIGHT`."""
    wanted = set(names)
    out: dict[str, np.ndarray] = {}
    for f, header in headers.items():
        here = [n for n in header[0] if n in wanted]
        if here:
            out.update(load_tensors(f, here, dtype=dtype, header=header, max_abs=MAX_WEIGHT))
    missing = sorted(wanted - set(out))
    if missing:
        raise CheckpointError(f"{next(iter(headers)).parent}: no tensor {missing[0]!r}")
    return out


def save_tensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``tensors`` (NumPy arrays of the :data:`DTYPES` kinds, no BF16) as a
    ``.safetensors`` file, atomically (a failed write leaves ``path`` as it was)."""
    header: dict[str, object] = {}
    arrays, offset = [], 0
    for name, value in tensors.items():
        arr = np.asarray(value)  # tobytes() writes C order
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        tag = next((k for k, v in DTYPES.items() if k != "BF16" and arr.dtype == v), None)
        if tag is None:
            raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot hold")
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for arr in arrays:
                fh.write(arr.tobytes())

    return atomic_write(path, write)
