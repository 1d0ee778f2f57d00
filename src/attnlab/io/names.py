"""Checkpoint names -> attnlab ``state_dict`` names, and loading through such a map.

A name map says which checkpoint tensors make each attnlab parameter: one tensor, or
several concatenated along axis 0 (e.g. Hugging Face BERT's separate query, key and value
weights become one fused ``in_proj_weight``). A new model brings its map; the checks
(every tensor present, float, of the right shape) and the reading are shared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from attnlab._validation import fmt_shape
from attnlab.io.checks import MAX_WEIGHT
from attnlab.io.files import CheckpointError
from attnlab.io.safetensors import FLOAT_DTYPES, load_tensors, read_header

__all__ = ["NameMap", "bert_name_map", "gpt2_name_map", "gpt2_transposed", "load_mapped", "load_transposed",
           "map_tensors"]

NameMap = dict[str, tuple[str, ...]]


def bert_name_map(num_layers: int) -> NameMap:
    """attnlab :class:`~attnlab.models.BertEncoder` names -> ``transformers`` ``BertModel`` names.

    >>> m = bert_name_map(1)
    >>> m["blocks.0.attn.in_proj_weight"]
    ('encoder.layer.0.attention.self.query.weight', 'encoder.layer.0.attention.self.key.weight', \
'encoder.layer.0.attention.self.value.weight')
    >>> m["blocks.0.ln_2.bias"]
    ('encoder.layer.0.output.LayerNorm.bias',)
    """
    names: NameMap = {
        "embeddings.tok_emb.weight": ("embeddings.word_embeddings.weight",),
        "embeddings.pos_emb.weight": ("embeddings.position_embeddings.weight",),
        "embeddings.type_emb.weight": ("embeddings.token_type_embeddings.weight",),
        "embeddings.ln.weight": ("embeddings.LayerNorm.weight",),
        "embeddings.ln.bias": ("embeddings.LayerNorm.bias",),
    }
    for i in range(num_layers):
        hf, ours = f"encoder.layer.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            fused = "in_proj_weight" if part == "weight" else "in_proj_bias"
            names[ours + "attn." + fused] = tuple(f"{hf}attention.self.{n}.{part}" for n in ("query", "key", "value"))
            names[f"{ours}attn.out_proj.{part}"] = (f"{hf}attention.output.dense.{part}",)
            names[f"{ours}ln_1.{part}"] = (f"{hf}attention.output.LayerNorm.{part}",)
            names[f"{ours}mlp.0.{part}"] = (f"{hf}intermediate.dense.{part}",)
            names[f"{ours}mlp.2.{part}"] = (f"{hf}output.dense.{part}",)
            names[f"{ours}ln_2.{part}"] = (f"{hf}output.LayerNorm.{part}",)
    return names


def source_shapes(name_map: NameMap, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape each checkpoint tensor must have, from the attnlab parameters' ``shapes``."""
    out = {}
    for ours, sources in name_map.items():
        shape = tuple(shapes[ours])
        part = (shape[0] // len(sources), *shape[1:]) if shape else shape
        for src in sources:
            out[src] = part
    return out


def _check(
    available: Mapping[str, tuple[str, bool, tuple[int, ...]]],
    name_map: NameMap,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    what: str,
    prefixes: Sequence[str],
) -> str:
    """The prefix under which ``available`` ({name: (dtype, is float, shape)}) holds every
    tensor of ``name_map`` with the right dtype and shape, else a clear error."""
    need = source_shapes(name_map, shapes)
    first = next(iter(need), None)
    prefix = next((p for p in prefixes if first is not None and p + first in available), prefixes[0])
    missing = [n for n in need if prefix + n not in available]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        hint = "" if len(missing) < len(need) else f" (this is not a {what} checkpoint)"
        raise CheckpointError(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}{hint}")
    for name, shape in need.items():
        dtype, is_float, found = available[prefix + name]
        if not is_float:
            raise CheckpointError(
                f"{where}: tensor {name!r} has dtype {dtype}, but should be a float ({', '.join(FLOAT_DTYPES)})"
            )
        if tuple(found) != shape:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {fmt_shape(found)}, but should be {fmt_shape(shape)}"
            )
    return prefix


def _assemble(name_map: NameMap, tensors: Mapping[str, np.ndarray], prefix: str, dtype) -> dict[str, np.ndarray]:
    out = {}
    for ours, sources in name_map.items():
        parts = [np.asarray(tensors[prefix + s], dtype=dtype) for s in sources]
        out[ours] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def map_tensors(
    tensors: Mapping[str, np.ndarray],
    name_map: NameMap,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtype=np.float32,
    prefixes: Sequence[str] = ("",),
    what: str = "matching",
) -> dict[str, np.ndarray]:
    """An attnlab state dict from checkpoint-named arrays in memory (checked as
    :func:`load_mapped` checks a file; errors say ``weights``)."""
    available = {}
    for name, value in tensors.items():
        arr = value if hasattr(value, "dtype") and hasattr(value, "shape") else np.asarray(value)
        kind = np.dtype(arr.dtype)
        available[name] = (str(kind), kind.kind == "f", tuple(arr.shape))
    prefix = _check(available, name_map, shapes, "weights", what, prefixes)
    return _assemble(name_map, tensors, prefix, dtype)


def load_mapped(
    path: str | os.PathLike,
    name_map: NameMap,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtype=np.float32,
    prefixes: Sequence[str] = ("",),
    what: str = "matching",
    header=None,
) -> dict[str, np.ndarray]:
    """Read the tensors of ``name_map`` from a safetensors file as an attnlab state dict.

    Everything is checked before any tensor is read: the header (see
    :func:`~attnlab.io.read_header`), every tensor present (under one of ``prefixes``,
    e.g. ``"bert."`` for ``BertForMaskedLM`` files), float, and of the shape ``shapes``
    asks. Other tensors (heads, poolers) are ignored. What is read must be finite and within
    :data:`~attnlab.io.checks.MAX_WEIGHT`.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: the message names the file, the tensor, and what was found and needed.
    """
    path = Path(path)
    header = read_header(path) if header is None else header
    infos = header[0]
    available = {n: (i.dtype, i.dtype in FLOAT_DTYPES, i.shape) for n, i in infos.items()}
    prefix = _check(available, name_map, shapes, str(path), what, prefixes)
    names = [prefix + s for sources in name_map.values() for s in sources]
    tensors = load_tensors(path, names, dtype=dtype, header=header, max_abs=MAX_WEIGHT)
    return _assemble(name_map, tensors, prefix, dtype)


def gpt2_name_map(num_layers: int) -> NameMap:
    """attnlab :class:`~attnlab.models.GPT2` names -> ``transformers`` ``GPT2Model`` names
    (``GPT2LMHeadModel`` files add a ``transformer.`` prefix; the output layer is the token
    embedding, so it has no tensor of its own). The four weights of
    :func:`gpt2_transposed` are stored as ``Conv1D`` matrices ``(in, out)``; load them with
    :func:`load_transposed`.

    >>> m = gpt2_name_map(1)
    >>> m["blocks.0.attn.in_proj_weight"], m["blocks.0.mlp.2.bias"]
    (('h.0.attn.c_attn.weight',), ('h.0.mlp.c_proj.bias',))
    """
    names: NameMap = {"tok_emb.weight": ("wte.weight",), "pos_emb.weight": ("wpe.weight",)}
    for i in range(num_layers):
        hf, ours = f"h.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            names[f"{ours}ln_1.{part}"] = (f"{hf}ln_1.{part}",)
        names[ours + "attn.in_proj_weight"] = (hf + "attn.c_attn.weight",)
        names[ours + "attn.in_proj_bias"] = (hf + "attn.c_attn.bias",)
        for ours_name, hf_name in (("attn.out_proj", "attn.c_proj"), ("ln_2", "ln_2"), ("mlp.0", "mlp.c_fc"),
                                   ("mlp.2", "mlp.c_proj")):
            for part in ("weight", "bias"):
                names[f"{ours}{ours_name}.{part}"] = (f"{hf}{hf_name}.{part}",)
    names["ln_f.weight"] = ("ln_f.weight",)
    names["ln_f.bias"] = ("ln_f.bias",)
    return names


def gpt2_transposed(num_layers: int) -> frozenset[str]:
    """The attnlab names of :func:`gpt2_name_map` whose tensors are ``Conv1D`` weights,
    stored ``(in, out)`` (``y = x W + b``) where attnlab's ``Linear`` keeps ``(out, in)``.

    >>> sorted(gpt2_transposed(1))
    ['blocks.0.attn.in_proj_weight', 'blocks.0.attn.out_proj.weight', 'blocks.0.mlp.0.weight', \
'blocks.0.mlp.2.weight']
    """
    parts = ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.0.weight", "mlp.2.weight")
    return frozenset(f"blocks.{i}.{p}" for i in range(num_layers) for p in parts)


def load_transposed(
    source: str | os.PathLike | Mapping[str, np.ndarray],
    name_map: NameMap,
    shapes: Mapping[str, tuple[int, ...]],
    transposed: frozenset[str],
    **options,
) -> dict[str, np.ndarray]:
    """:func:`load_mapped` (``source`` a file) or :func:`map_tensors` (``source`` a dict) for
    checkpoints that store the ``transposed`` parameters as their transpose (``Conv1D``
    weights): those tensors are checked in the stored layout (an error shows the shape the
    file should hold) and come back in attnlab's, as transposed views.

    >>> w = {"c.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}  # (in, out)
    >>> load_transposed(w, {"lin.weight": ("c.weight",)}, {"lin.weight": (3, 2)},
    ...                 frozenset({"lin.weight"}))["lin.weight"].shape
    (3, 2)
    """
    stored = {k: tuple(reversed(s)) if k in transposed else tuple(s) for k, s in shapes.items()}
    if isinstance(source, Mapping):
        state = map_tensors(source, name_map, stored, **options)
    else:
        state = load_mapped(source, name_map, stored, **options)
    return {k: v.T if k in transposed else v for k, v in state.items()}
