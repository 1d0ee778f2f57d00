"""Checkpoints of a trained :class:`~attnlab.models.TinyTransformer`.

A checkpoint is an ``.npz`` file (read with ``allow_pickle=False``; never pickle): one array
per parameter under its ``state_dict`` name, plus ``__attnlab__``, a JSON string with the
model config, the task and training metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write
from attnlab._validation import fmt_shape
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
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

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an attnlab checkpoint, a missing tensor (named, with the shape the
            model needs) or a tensor of the wrong shape (named, with both shapes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(path)!r} is not a readable .npz checkpoint: {exc}") from None
    if META_KEY not in arrays:
        raise ValueError(f"{str(path)!r} is not an attnlab checkpoint (no {META_KEY!r} entry)")
    try:
        header = json.loads(str(arrays.pop(META_KEY)))
        if header.get("format") != FORMAT:
            raise ValueError(f"unknown format {header.get('format')!r}")
        config = TinyTransformerConfig.from_dict(header["model"])
        task_d = dict(header["task"])
        task_d.pop("name", None)
        task = RecallTask(**task_d)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(path)!r} has a bad header: {exc}") from None
    model = TinyTransformer(config, rng=np.random.default_rng(0))
    for name, p in model.named_parameters():
        if name not in arrays:
            raise ValueError(
                f"checkpoint {str(path)!r} has no tensor {name!r} "
                f"(the model needs shape {fmt_shape(p.shape)})"
            )
    model.load_state_dict(arrays)
    return model, task, header.get("meta", {})
