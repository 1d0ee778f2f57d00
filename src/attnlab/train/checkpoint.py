"""Checkpoints of a trained :class:`~attnlab.models.TinyTransformer`.

A checkpoint is an ``.npz`` file (read with ``allow_pickle=False``; never pickle): one array
per parameter under its ``state_dict`` name, plus ``__attnlab__``, a JSON string with the
model config, the task and training metadata.
"""

from __future__ import annotations

import errno
import json
import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write
from attnlab._validation import fmt_shape
from attnlab.io.files import file_kind
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.train.sizes import parameter_count
from attnlab.train.tasks import RecallTask

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "attnlab-tiny-transformer-1"
META_KEY = "__attnlab__"


def save_checkpoint(
    path: str | os.PathLike,
    model: TinyTransformer,
    task: RecallTask,
    *,
    state: dict[str, np.ndarray] | None = None,
    meta: dict | None = None,
) -> None:
    """Write ``model``'s weights (or the given ``state`` dict), config and ``task`` to
    ``path`` (an ``.npz`` file), atomically: a failed write leaves ``path`` as it was."""
    state = model.state_dict() if state is None else state
    header = {
        "format": FORMAT,
        "model": model.config.to_dict(),
        "task": {"name": "recall", **task.to_dict()},
        "meta": meta or {},
    }
    arrays = {name: np.asarray(a) for name, a in state.items()}
    arrays[META_KEY] = np.array(json.dumps(header))

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    atomic_write(path, write)


def load_checkpoint(path: str | os.PathLike) -> tuple[TinyTransformer, RecallTask, dict]:
    """Read a checkpoint written by :func:`save_checkpoint`: ``(model, task, meta)``.

    The file is untrusted: everything is checked before anything large is allocated. The
    archive's entries, their ``.npy`` headers and the header's config are read first; an
    archive that expands far beyond its size (a zip bomb), or a config that needs far more
    weights than the file holds, is refused without reading the data. Pickled objects are
    never loaded.

    Raises:
        FileNotFoundError: no such file.
        ValueError: naming the file: a directory or device instead of a file, an empty,
            truncated or corrupt file, not an attnlab checkpoint, a bad header, a missing
            tensor (named, with the shape the model needs), a tensor of the wrong shape
            (named, with both shapes), or NaN/infinite weights (the tensor named).

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     bad = pathlib.Path(d) / "model.npz"
    ...     _ = bad.write_bytes(b"not a zip archive")
    ...     load_checkpoint(bad)
    Traceback (most recent call last):
    ...
    ValueError: checkpoint '...model.npz' is not an .npz checkpoint (it is not a zip archive)
    """
    path = Path(path)
    name = str(path)
    header, arrays = _read_npz(path)
    try:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            got = header.get("format") if isinstance(header, dict) else type(header).__name__
            raise ValueError(f"unknown format {got!r}, expected {FORMAT!r}")
        config = TinyTransformerConfig.from_dict(dict(header["model"]))
        task_d = dict(header["task"])
        task_d.pop("name", None)
        task = RecallTask(**task_d)
        meta = dict(header.get("meta") or {})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {name!r} has a bad header: {exc}") from None
    if task.vocab_size != config.vocab_size or task.seq_len > config.context_length:
        raise ValueError(
            f"checkpoint {name!r} has a bad header: the task needs {task.vocab_size} tokens and "
            f"a context of {task.seq_len}, the model has {config.vocab_size} and "
            f"{config.context_length}"
        )
    # The config decides how much the model allocates: refuse one that needs far more weights
    # than the file holds before building it (a missing tensor is named further down).
    need, have = parameter_count(config), sum(a.size for a in arrays.values())
    if need > 2 * have + 65536:
        raise ValueError(
            f"checkpoint {name!r} has a bad header: its config needs {need:,} weights, but the "
            f"file holds {have:,}"
        )
    model = TinyTransformer(config, rng=np.random.default_rng(0))
    for pname, p in model.named_parameters():
        if pname not in arrays:
            raise ValueError(
                f"checkpoint {name!r} has no tensor {pname!r} "
                f"(the model needs shape {fmt_shape(p.shape)})"
            )
    try:
        model.load_state_dict(arrays)
    except (KeyError, TypeError, ValueError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"checkpoint {name!r}: {msg}") from None
    return model, task, meta


# A checkpoint's JSON header is a few kB; anything far bigger is not one.
MAX_HEADER_BYTES = 1 << 20
# Deflate packs float weights to about their size; only a zip bomb expands 50-fold.
MAX_EXPANSION = 50


def _read_npz(path: Path) -> tuple[object, dict[str, np.ndarray]]:
    """The JSON header and the float arrays of an ``.npz`` checkpoint, all checked.

    Raises FileNotFoundError or a ValueError naming ``path``.
    """
    name = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {name!r} does not exist", name) from None
    except OSError as exc:
        raise ValueError(f"checkpoint {name!r} cannot be read: {exc.strerror or exc}") from None
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise ValueError(f"checkpoint {name!r} is {kind}, not a checkpoint file")
    if st.st_size == 0:
        raise ValueError(f"checkpoint {name!r} is empty (0 bytes), not an .npz checkpoint")
    try:
        with open(path, "rb") as f:
            if f.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
                raise _Bad("is not an .npz checkpoint (it is not a zip archive)")
            f.seek(0)
            with zipfile.ZipFile(f) as zf:
                return _read_members(zf, st.st_size)
    except _Bad as exc:
        raise ValueError(f"checkpoint {name!r} {' '.join(str(exc).split())}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError,
            ValueError, OSError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(
            f"checkpoint {name!r} is not a readable .npz checkpoint (truncated or corrupt: {why})"
        ) from None


class _Bad(Exception):
    """A problem with the file, worded to follow its name."""


def _read_members(zf: zipfile.ZipFile, file_size: int) -> tuple[object, dict[str, np.ndarray]]:
    infos = zf.infolist()
    stored = sum(i.compress_size for i in infos)
    expanded = sum(i.file_size for i in infos)
    if stored > file_size:
        raise _Bad(f"is corrupt: its entries claim {stored:,} bytes of a {file_size:,}-byte file")
    if expanded > MAX_EXPANSION * max(stored, 1) + MAX_HEADER_BYTES:
        raise _Bad(
            f"expands from {stored:,} to {expanded:,} bytes ({expanded / max(stored, 1):.0f}-fold): "
            "refused as a zip bomb, not an attnlab checkpoint"
        )
    members = {}
    for info in infos:
        if not info.filename.endswith(".npy") or info.is_dir():
            raise _Bad(f"is not an attnlab checkpoint (unexpected entry {info.filename!r})")
        members[info.filename[: -len(".npy")]] = info
    if META_KEY not in members:
        raise _Bad(f"is not an attnlab checkpoint (no {META_KEY!r} entry)")
    if members[META_KEY].file_size > MAX_HEADER_BYTES:
        raise _Bad(
            f"has a bad header: {members[META_KEY].file_size:,} bytes, more than a "
            f"checkpoint's header ever needs ({MAX_HEADER_BYTES:,})"
        )
    text = _read_npy(zf, members.pop(META_KEY), META_KEY, kinds="U")
    try:
        header = json.loads(str(text[()]) if text.ndim == 0 else "")
    except ValueError as exc:
        raise _Bad(f"has a bad header: not JSON ({exc})") from None
    arrays = {}
    for key, info in members.items():
        arr = _read_npy(zf, info, key, kinds="f")
        bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
        if bad:
            raise _Bad(f"has NaN or infinite weights: {bad:,} of the {arr.size:,} values of "
                       f"tensor {key!r}")
        arrays[key] = arr
    return header, arrays


def _read_npy(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, *, kinds: str) -> np.ndarray:
    """One ``.npy`` entry: its header is checked against the entry's size before the data
    is read; only dtypes of the given kinds ('f' floats, 'U' text) are accepted."""
    fmt = np.lib.format
    with zf.open(info) as m:
        try:
            version = fmt.read_magic(m)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(m)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(m)
            else:
                raise ValueError(f".npy version {version}")
        except Exception as exc:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
            raise _Bad(f"has a corrupt entry {key!r}: {exc}") from None
        if dtype.hasobject or dtype.kind not in kinds or any(int(n) < 0 for n in shape):
            what = "Python objects (pickle), which attnlab never loads" if dtype.hasobject else dtype
            raise _Bad(f"has entry {key!r} of dtype {what} and shape {shape}: not a checkpoint's")
        nbytes = math.prod(shape) * dtype.itemsize
        if m.tell() + nbytes != info.file_size:
            raise _Bad(
                f"has a corrupt entry {key!r}: its header says {fmt_shape(shape)} {dtype} "
                f"({nbytes:,} bytes) in {info.file_size - m.tell():,} bytes"
            )
        data = m.read(nbytes)
    if len(data) != nbytes:
        raise _Bad(f"is truncated: entry {key!r} ends early")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


