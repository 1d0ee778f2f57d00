"""Checkpoints of a trained :class:`~attnlab.models.TinyTransformer` and the ``explain``
backend that reads them.

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

__all__ = ["explain_checkpoint", "load_checkpoint", "save_checkpoint"]

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


def explain_checkpoint(
    text: str, *, seed: int = 0, dim: int = 128, heads: int = 4, checkpoint=None, **_
):
    """The ``explain`` backend for a trained recall model (``attnlab explain --checkpoint``).

    ``text`` is a space-separated sequence of the task's tokens, e.g.
    ``"k1 v5 k2 v9 k1"``; the last layer shows each queried key attending to the pair of
    its first occurrence (the value right after the matching key, which the first layer
    has tagged with that key). ``seed``, ``dim`` and ``heads`` do not apply (the
    checkpoint fixes the model).

    Raises:
        ValueError: no checkpoint given, unknown tokens, or a text longer than the model's
            context.
    """
    from attnlab.explain import Explanation

    if checkpoint is None:
        raise ValueError("the 'checkpoint' model needs checkpoint=PATH (a file from attnlab train)")
    model, task, _meta = load_checkpoint(checkpoint)
    ids = task.encode(text)
    if len(ids) > model.config.context_length:
        raise ValueError(
            f"text has {len(ids)} tokens, but the model's context holds "
            f"{model.config.context_length}"
        )
    out = model.inspect(ids)
    tokens = text.split()
    probs = np.exp(out["logits"] - out["logits"].max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    notes = []
    last = out["attentions"][-1].mean(axis=0)  # (T, T), heads averaged
    for t, tok in enumerate(tokens):
        earlier = [j for j in range(t) if tokens[j] == tok]
        if not tok.startswith("k") or not earlier:
            continue
        j = earlier[0]
        guess = int(probs[t].argmax())
        focus = int(last[t].argmax())
        notes.append(
            f"query {tok!r} at position {t}: predicts {task.vocab[guess]!r} "
            f"(p={probs[t, guess]:.2f}); the last layer attends most to position {focus} "
            f"({tokens[focus]!r}); the matching key is at {j}, its value at {j + 1}"
        )
    c = model.config
    return Explanation(
        text=text,
        tokens=tokens,
        model=(
            f"TinyTransformer ({c.n_layers} layers, {c.n_heads} heads, d_model {c.d_model}) "
            f"trained on associative recall: {Path(checkpoint).name}"
        ),
        attentions=out["attentions"].astype(np.float64),
        static=out["static"].astype(np.float64),
        contextual=out["contextual"].astype(np.float64),
        notes=notes,
    )
