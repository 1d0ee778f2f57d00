"""A sentence-transformers folder's pipeline, read from its JSON files (no torch).

Two layouts are read:

- classic: ``modules.json``; ``sentence_bert_config.json`` with ``max_seq_length`` and
  ``do_lower_case``; ``1_Pooling/config.json`` with ``pooling_mode_*_token(s)`` flags;
- sentence-transformers 6: ``1_Pooling/config.json`` with ``pooling_mode`` (``"cls"``,
  ``"mean"``, ``"max"``), a ``2_Normalize`` module, and the length in
  ``tokenizer_config.json``'s ``model_max_length``.

A folder without ``modules.json`` is a plain transformer, which sentence-transformers
wraps with mean pooling and no normalisation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.io.files import CheckpointError, read_json

__all__ = ["POOLING_MODES", "SentencePipeline", "read_pipeline"]

POOLING_MODES = ("mean", "cls", "max")
# classic Pooling flags -> mode name (the order sentence-transformers concatenates them in)
_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULES = {"Transformer": "transformer", "Pooling": "pooling", "Normalize": "normalize"}


@dataclass(frozen=True)
class SentencePipeline:
    """What a sentence-transformers folder does to a text.

    Attributes:
        model_folder: the folder of the transformer (``config.json``, weights, tokenizer).
        pooling: ``"mean"``, ``"cls"`` or ``"max"``.
        normalize: whether the embeddings are L2-normalised.
        max_seq_length: ``sentence_bert_config.json``'s ``max_seq_length`` (None: not set).
        lower_case: ``do_lower_case``: texts are lower-cased before tokenisation.
    """

    model_folder: Path
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    lower_case: bool = False


def _pooling(path: Path) -> str:
    cfg = read_json(path)
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _FLAGS.items() if cfg.get(flag) is True]
        mode = modes[0] if len(modes) == 1 else (modes or ["mean"])
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in POOLING_MODES:
        raise CheckpointError(f"{path}: pooling {mode!r} is not supported (attnlab pools with one of "
                              f"{', '.join(POOLING_MODES)})")
    return mode


def _positive_int(value, path: Path, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: {field} should be a positive int, got {value!r:.40}")
    return value


def read_pipeline(folder: str | os.PathLike) -> SentencePipeline:
    """The pipeline of ``folder`` (see the module docstring); every file is checked.

    Raises:
        CheckpointError: a malformed file or a module attnlab does not run (Dense, ...).
    """
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return SentencePipeline(folder, **_transformer_options(folder))
    raw = read_json(modules_file, kind=list)
    found: dict[str, Path] = {}
    for i, module in enumerate(raw):
        kind = module.get("type") if isinstance(module, dict) else None
        sub = module.get("path", "") if isinstance(module, dict) else None
        if not isinstance(kind, str) or not isinstance(sub, str) or ".." in Path(sub).parts or Path(sub).is_absolute():
            raise CheckpointError(f"{modules_file}: module {i} should have a 'type' and a relative 'path'")
        role = _MODULES.get(kind.rsplit(".", 1)[-1])
        if role is None or role in found:
            why = "twice" if role else "is not supported (attnlab runs Transformer, Pooling, Normalize)"
            raise CheckpointError(f"{modules_file}: module {kind!r} {why}")
        found[role] = folder / sub
    if "transformer" not in found:
        raise CheckpointError(f"{modules_file}: no Transformer module")
    model_folder = found["transformer"]
    pooling = _pooling(found["pooling"] / "config.json") if "pooling" in found else "mean"
    return SentencePipeline(model_folder, pooling, "normalize" in found, **_transformer_options(model_folder))


def _transformer_options(model_folder: Path) -> dict:
    """``max_seq_length`` and ``lower_case`` from ``sentence_bert_config.json``, if there is one."""
    st_config = model_folder / "sentence_bert_config.json"
    if not st_config.exists():
        return {}
    cfg = read_json(st_config)
    max_len = cfg.get("max_seq_length")
    if max_len is not None:
        max_len = _positive_int(max_len, st_config, "max_seq_length")
    lower = cfg.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise CheckpointError(f"{st_config}: do_lower_case should be true or false, got {lower!r:.40}")
    return {"max_seq_length": max_len, "lower_case": lower}

