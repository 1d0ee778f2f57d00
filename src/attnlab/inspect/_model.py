"""What the analysis functions need to know about a model, read from its parts (never by
running a layer again): the blocks, the heads, cached activations, the per-head output
projection, the final norm and the unembedding."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnlab._validation import shape_error

RESID_PRE = "blocks.{i}.hook_resid_pre"
RESID_POST = "blocks.{i}.hook_resid_post"
ATTN_OUT = "blocks.{i}.hook_attn_out"
MLP_OUT = "blocks.{i}.hook_mlp_out"
Z = "blocks.{i}.attn.hook_z"
PATTERN = "blocks.{i}.attn.hook_pattern"


def blocks(model) -> list:
    """The model's transformer blocks, first to last (block ``i`` is hook prefix ``blocks.{i}``)."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "run_with_cache"):
        raise TypeError(f"model must be an attnlab model with hook points (.layers, .run_with_cache), "
                        f"got {type(model).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("model has no transformer blocks")
    return layers


def num_heads(model) -> int:
    """Query heads per block (every block has the same count)."""
    return int(blocks(model)[0].attn.num_heads)


def check_cache(cache: object) -> Mapping:
    if not isinstance(cache, Mapping):
        raise TypeError(f"cache must be the mapping returned by model.run_with_cache(...), got "
                        f"{type(cache).__name__}")
    return cache


def cached(cache: Mapping, name: str, what: str) -> np.ndarray:
    """``cache[name]`` as an array, or a ``KeyError`` that says which call needs it and how to
    keep it."""
    try:
        return np.asarray(cache[name])
    except KeyError:
        raise KeyError(f"the cache has no {name!r}, which {what} needs: run model.run_with_cache(inputs) "
                       f"with no names_filter, or one that keeps {name!r}") from None


def token_ids(inputs: object, name: str) -> np.ndarray:
    """``inputs`` as an integer array ``(B, T)`` or ``(T,)``."""
    ids = np.asarray(inputs)
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {ids.dtype}")
    if ids.ndim not in (1, 2) or ids.shape[-1] == 0:
        raise shape_error(name, ids.shape, "(B, T) or (T,) with T >= 1")
    return ids


def output_projection(attn) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W_O (H, D, E), b_O (E,) or None)``: the attention output is
    ``sum_h z[..., h, :] @ W_O[h] + b_O``."""
    W_O = getattr(attn, "W_O", None)
    if W_O is not None:
        return np.asarray(W_O), (None if getattr(attn, "b_O", None) is None else np.asarray(attn.b_O))
    out = attn.out_proj  # (E, H*D), torch's layout
    H, E = attn.num_heads, out.weight.shape[0]
    W = np.asarray(out.weight.data).T.reshape(H, -1, E)
    return W, (None if out.bias is None else np.asarray(out.bias.data))


def decoder_head(model, what: str):
    """``(model.ln_final, model.unembed)``, or a ``TypeError`` saying ``what`` needs a decoder."""
    norm, unembed = getattr(model, "ln_final", None), getattr(model, "unembed", None)
    if norm is None or unembed is None:
        raise TypeError(f"{type(model).__name__} has no final norm and unembedding (ln_final, unembed): "
                        f"the {what} is defined for decoders")
    return norm, unembed


def norm_linearisation(norm, resid: np.ndarray) -> tuple[bool, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The final norm at the real residual ``resid (..., E)``, as a linear map.

    Returns ``(centre, scale (..., 1), weight (E,) or None, bias (E,) or None)`` with
    ``norm(x) = weight * (x - centre * mean(x)) / scale + bias`` at ``x = resid``: a
    LayerNorm centres and divides by ``sqrt(var(x) + eps)``, an RMSNorm divides by
    ``sqrt(mean(x**2) + eps)``.
    """
    from attnlab.nn.layers import LayerNorm

    kind = type(norm).__name__
    if not (isinstance(norm, LayerNorm) or kind == "RMSNorm"):
        raise TypeError(f"the final norm must be a LayerNorm or an RMSNorm to be linearised, got {kind}")
    centre = isinstance(norm, LayerNorm)
    x = resid.astype(np.float64)
    if centre:
        x = x - x.mean(axis=-1, keepdims=True)
    scale = np.sqrt((x * x).mean(axis=-1, keepdims=True) + float(norm.eps))
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    weight = None if weight is None else np.asarray(getattr(weight, "data", weight), np.float64)
    bias = None if bias is None else np.asarray(getattr(bias, "data", bias), np.float64)
    return centre, scale, weight, bias


def unembedding(model, E: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """``(W_U (E, V), b_U (V,) or None)``: ``model.unembed(y) = y @ W_U + b_U``.

    Read from ``model.W_U``/``model.b_U`` when the model has them, else from an ``unembed``
    layer's ``weight (V, E)``/``bias``, else found from ``unembed`` itself (it is linear:
    ``b_U = unembed(0)``, ``W_U = unembed(I) - b_U``).
    """
    if getattr(model, "W_U", None) is not None:
        b = getattr(model, "b_U", None)
        return np.asarray(model.W_U), None if b is None else np.asarray(b)
    layer = getattr(model, "unembed", None)
    weight = getattr(layer, "weight", None)
    if weight is not None:
        bias = getattr(layer, "bias", None)
        return (np.asarray(getattr(weight, "data", weight)).T,
                None if bias is None else np.asarray(getattr(bias, "data", bias)))
    probe = np.concatenate([np.zeros((1, E), dtype), np.eye(E, dtype=dtype)])[None]  # (1, 1 + E, E)
    out = np.asarray(layer(probe))[0].astype(np.float64)
    b = out[0]
    return out[1:] - b, (b if np.any(b) else None)
