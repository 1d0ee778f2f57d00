"""The Gemma family built from attnlab's blocks: Gemma 2 and Gemma 3's text model, from a
Hugging Face folder.

The same shared layers as :mod:`attnlab.models.llama`, in Gemma's arrangement, as
``transformers``' ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` compute it::

    ids (B, T) -> token embedding * sqrt(D)  (the factor in the embedding's dtype)
               -> n x TransformerBlock with sandwich norms:
                    RMSNorm -> Attention(grouped-query heads, rotary positions,
                                         scale query_pre_attn_scalar^-1/2, [soft-capped
                                         scores], [QK-norm], [sliding window])
                            -> RMSNorm -> + residual
                    RMSNorm -> GatedFeedForward (GELU-tanh) -> RMSNorm -> + residual
               -> RMSNorm -> output layer (tied) -> [cap * tanh(logits / cap)] -> logits

Every RMSNorm scales by ``1 + weight``. Gemma 2 alternates local (sliding-window) and
global layers, the even layers local, and soft-caps the attention scores
(``attn_logit_softcapping``) and the logits (``final_logit_softcapping``). Gemma 3 has
five local layers to one global (``layer_types``, or ``sliding_window_pattern``), QK-norm,
and a rotary base of its own for the local layers (``rope_local_base_freq``); as in
``transformers``, its attention is not soft-capped even when its config names a cap.

All the rest (loading, generation, the text methods, ``inspect``, ``trace``, the hook
points) is :class:`~attnlab.models.llama.Llama`'s. Shapes: ``B`` sequences, ``T`` tokens,
``D`` model width, ``V`` vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from attnlab.core._namespace import namespace
from attnlab.core.rotary import RopeConfig
from attnlab.io.checks import check_decoder_config
from attnlab.io.files import CheckpointError
from attnlab.models.llama import Llama, LlamaConfig, check_family
from attnlab.models.registry import FAMILIES as _REGISTRY
from attnlab.nn.layers import RMSNorm, RotaryEmbedding

__all__ = ["FAMILIES", "Gemma", "GemmaConfig", "gemma_name_map"]

#: ``model_type`` -> ``transformers``' class: the registry's families arranged by this module.
FAMILIES = {f.model_types[0]: f.architectures[0] for f in _REGISTRY.values() if f.module == __name__}

# the local:global pattern when a config has no layer_types (transformers' defaults)
_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def _cap(value, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive float or None, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """The architecture of a Gemma 2 or Gemma 3 text model: :class:`LlamaConfig`'s fields
    (``sliding_windows`` per layer, ``qk_norm`` for Gemma 3) and Gemma's own.

    Attributes:
        query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``
            (None: ``1 / sqrt(head_dim)``).
        attn_logit_softcapping: the attention scores' soft-cap (None: off).
        final_logit_softcapping: the logits' soft-cap (None: off).
        local_rope_theta, local_rope_scaling: the rotary base and scaling of the local
            (sliding-window) layers (Gemma 3's ``rope_local_base_freq``; None: the global
            layers' ``rope_theta``, no scaling).

    >>> c = GemmaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    ...                 num_attention_heads=2, sliding_windows=(4, None), query_pre_attn_scalar=16,
    ...                 attn_logit_softcapping=50.0)
    >>> c.attn_scale, c.window(0), c.window(1), c.model_type
    (0.25, 4, None, 'gemma2')
    """

    hidden_act: str = "gelu_pytorch_tanh"
    model_type: str = "gemma2"
    tie_word_embeddings: bool = True
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: Mapping | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _cap(self.attn_logit_softcapping, "attn_logit_softcapping")
        _cap(self.final_logit_softcapping, "final_logit_softcapping")
        _cap(self.query_pre_attn_scalar, "query_pre_attn_scalar")
        self.local_rope  # noqa: B018  (validates the local layers' rotary parameters)

    def _families(self) -> Mapping[str, str]:
        return FAMILIES

    @property
    def attn_scale(self) -> float | None:
        """The attention's scale (None: ``1 / sqrt(head_dim)``)."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @property
    def local_rope(self) -> RopeConfig:
        """The rotary embedding of the local (sliding-window) layers."""
        if self.local_rope_theta is None and self.local_rope_scaling is None:
            return self.rope
        theta = self.rope_theta if self.local_rope_theta is None else self.local_rope_theta
        return RopeConfig.from_hf({"rope_theta": theta, "rope_scaling": dict(self.local_rope_scaling or {}),
                                   "max_position_embeddings": self.max_position_embeddings},
                                  head_dim=self.head_size)

    def rope_for(self, layer: int) -> RopeConfig:
        """The rotary embedding of block ``layer`` (0-based): local or global."""
        return self.local_rope if self.window(layer) is not None else self.rope

    @classmethod
    def from_dict(cls, data: Mapping, *, where: object = "config") -> GemmaConfig:
        """A config from a ``transformers`` ``config.json`` dict of a ``Gemma2ForCausalLM`` or a
        ``Gemma3ForCausalLM`` (``model_type`` ``gemma3_text``): per-layer windows from
        ``layer_types`` (else the family's pattern), the rotary parameters per layer type.

        Raises:
            CheckpointError: an unsupported ``model_type``/``architectures`` (the supported
                ones listed), bidirectional attention, an unsupported ``rope_scaling`` type,
                a missing or bad field.
        """
        kind = check_family(data, where, FAMILIES)
        check_decoder_config(data, where)
        if data.get("use_bidirectional_attention"):
            raise CheckpointError(f"{where}: use_bidirectional_attention is not supported (a causal decoder only)")
        n = data["num_hidden_layers"]
        try:
            local = _local_layers(kind, data, n)
            window = data.get("sliding_window", 4096)  # transformers' default
            if any(local) and window is None:
                raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
            (theta, scaling), (local_theta, local_scaling) = _rope_parameters(kind, data)
            bias = bool(data.get("attention_bias", False))
            eos = data.get("eos_token_id")
            return cls(
                vocab_size=data["vocab_size"], hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"], num_hidden_layers=n,
                num_attention_heads=data["num_attention_heads"],
                num_key_value_heads=data.get("num_key_value_heads"), head_dim=data.get("head_dim"),
                max_position_embeddings=data.get("max_position_embeddings", 8192),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                qkv_bias=bias, out_bias=bias, qk_norm=kind == "gemma3_text",
                tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
                sliding_windows=tuple(window if s else None for s in local) if any(local) else None,
                hidden_act=data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh",
                model_type=kind, bos_token_id=data.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos, pad_token_id=data.get("pad_token_id"),
                query_pre_attn_scalar=data.get("query_pre_attn_scalar", 256),
                # transformers' Gemma 3 attention passes no soft-cap to its attention functions
                attn_logit_softcapping=data.get("attn_logit_softcapping") if kind == "gemma2" else None,
                final_logit_softcapping=data.get("final_logit_softcapping"),
                local_rope_theta=local_theta, local_rope_scaling=local_scaling,
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: {exc}") from exc


def _local_layers(kind: str, data: Mapping, n: int) -> tuple[bool, ...]:
    """Which layers are local (sliding-window): ``layer_types`` when given, else every
    ``pattern``-th layer global (Gemma 2: odd layers; Gemma 3: ``sliding_window_pattern``, 6)."""
    types = data.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        unknown = sorted({t for t in types} - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} not supported (sliding_attention, full_attention)")
        return tuple(t == "sliding_attention" for t in types)
    pattern = int(data.get("sliding_window_pattern", _PATTERN[kind])) if kind == "gemma3_text" else _PATTERN[kind]
    return tuple(bool((i + 1) % pattern) for i in range(n))


def _rope_parameters(kind: str, data: Mapping):
    """``((theta, scaling), (local theta, local scaling))`` from ``rope_parameters`` (per
    layer type for Gemma 3) or the older ``rope_theta``/``rope_scaling``/``rope_local_base_freq``."""

    def split(params: Mapping, default_theta: float):
        params = dict(params or {})
        theta = float(params.pop("rope_theta", default_theta))
        params.pop("partial_rotary_factor", None)
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
        return theta, scaling

    params = data.get("rope_parameters") or {}
    if kind == "gemma2":
        return split({**params, **(data.get("rope_scaling") or {})}, data.get("rope_theta", 10000.0)), (None, None)
    if "full_attention" in params or "sliding_attention" in params:
        glob = split(params.get("full_attention"), data.get("rope_theta", 1_000_000.0))
        local = split(params.get("sliding_attention"), data.get("rope_local_base_freq", 10_000.0))
    else:
        glob = split({**params, **(data.get("rope_scaling") or {})}, data.get("rope_theta", 1_000_000.0))
        local = (float(data.get("rope_local_base_freq", 10_000.0)), None)
    return glob, local


def gemma_name_map(config: GemmaConfig) -> dict[str, tuple[str, ...]]:
    """attnlab parameter name -> the ``transformers`` tensor(s) it is made of: Llama's
    (:func:`~attnlab.models.llama.llama_name_map`) with Gemma's four norms per block.

    >>> c = GemmaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                 num_attention_heads=2)
    >>> m = gemma_name_map(c)
    >>> m["blocks.0.ln_2.weight"], m["blocks.0.ln_2_post.weight"]
    (('model.layers.0.pre_feedforward_layernorm.weight',), ('model.layers.0.post_feedforward_layernorm.weight',))
    """
    from attnlab.models.llama import llama_name_map

    m = llama_name_map(config)
    for i in range(config.num_hidden_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        m[b + "ln_1_post.weight"] = (h + "post_attention_layernorm.weight",)
        m[b + "ln_2.weight"] = (h + "pre_feedforward_layernorm.weight",)
        m[b + "ln_2_post.weight"] = (h + "post_feedforward_layernorm.weight",)
    return m


class Gemma(Llama):
    """A Gemma 2 or Gemma 3 causal language model (``transformers``' ``Gemma2ForCausalLM``,
    ``Gemma3ForCausalLM``; eval mode), with :class:`~attnlab.models.llama.Llama`'s interface:
    :meth:`from_pretrained` (a Hugging Face folder), ``model(input_ids, attention_mask)`` ->
    logits, ``generate``, ``generate_text``, ``inspect``, ``trace`` and the hook points.

    Hook points: Llama's, and each block's sandwich norms ``blocks.{i}.ln1_post`` and
    ``ln2_post``; ``hook_embed`` is the scaled embedding, ``blocks.{i}.hook_attn_out``
    and ``hook_mlp_out`` the normed outputs the residual adds (TransformerLens's Gemma 2
    names), ``attn.hook_attn_scores`` the soft-capped, masked scores.

    Parameter names: Llama's, with ``blocks.{i}.ln_1_post.weight`` (post-attention norm),
    ``blocks.{i}.ln_2.weight`` (pre-feed-forward) and ``blocks.{i}.ln_2_post.weight``.

    Args: as :class:`~attnlab.models.llama.Llama`'s, with a :class:`GemmaConfig`.

    >>> cfg = GemmaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    ...                   sliding_windows=(3, None), attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    >>> model = Gemma(cfg, rng=np.random.default_rng(0))
    >>> logits = model(np.array([[1, 2, 3]]))
    >>> logits.shape, bool(np.abs(logits).max() < 30.0), model.generate(np.array([[1, 2, 3]]), 4).shape
    ((1, 3, 50), True, (1, 7))
    """

    config_class = GemmaConfig
    name_map = staticmethod(gemma_name_map)

    def _norm(self, d: int, dtype) -> RMSNorm:
        """Gemma's RMSNorm, whose weight is an offset from 1 (``x * (1 + w)``)."""
        return RMSNorm(d, self.config.rms_norm_eps, add_unit_offset=True, dtype=dtype)

    def _attention_options(self, i: int) -> dict:
        """The local or global rotary slot of block ``i``, the score scale and soft-cap."""
        c = self.config
        return {"rotary": RotaryEmbedding(c.rope_for(i)), "scale": c.attn_scale, "softcap": c.attn_logit_softcapping}

    def _block_norms(self, dtype) -> dict:
        """The sandwich: a norm before and after each sublayer."""
        D = self.config.hidden_size
        return {"ln_1": self._norm(D, dtype), "ln_2": self._norm(D, dtype), "post_attn_norm": self._norm(D, dtype),
                "post_mlp_norm": self._norm(D, dtype)}

    @property
    def embed_scale(self):
        """The embeddings' factor ``sqrt(D)``, as ``transformers`` keeps it: a float32
        buffer cast to the embedding's dtype."""
        scale = np.float32(math.sqrt(self.config.hidden_size))
        dtype = self.tok_emb.weight.dtype
        return scale.astype(dtype) if isinstance(dtype, np.dtype) else scale

    def _embed(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        e = self.tok_emb(ids)  # another library's arrays take the factor as a Python number (the same value)
        return self.hook_embed(e * (self.embed_scale if type(e) is np.ndarray else float(self.embed_scale)))

    def _embed_backward(self, grad: np.ndarray) -> None:
        self.tok_emb.backward(self.hook_embed.backward(grad) * self.embed_scale)

    def _head_saved(self, logits: np.ndarray) -> dict:
        cap = self.config.final_logit_softcapping
        return {} if cap is None else {"tanh": logits / cap}  # a copy: the caller may change the logits

    def _unembed_backward(self, grad: np.ndarray, saved: dict) -> np.ndarray:
        if "tanh" in saved:  # through cap * tanh(logits / cap)
            t = saved["tanh"]
            grad = grad * (1.0 - t * t)
        return super()._unembed_backward(grad, saved)

    def unembed(self, h: np.ndarray) -> np.ndarray:
        """The output layer ``(..., D) -> (..., V)`` of a normalized residual, soft-capped
        (``cap * tanh(logits / cap)``) with ``final_logit_softcapping``: what the model's
        logits are (:attr:`W_U` is the linear part alone)."""
        logits = super().unembed(h)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        if type(logits) is not np.ndarray:  # weights of another library (Module.to)
            return namespace(logits).tanh(logits / cap) * cap
        logits /= cap
        np.tanh(logits, out=logits)
        logits *= cap
        return logits
