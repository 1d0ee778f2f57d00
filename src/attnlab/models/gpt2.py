"""GPT-2 built from attnlab's blocks: a causal language model that loads Hugging Face
checkpoints and generates with a key/value cache.

:class:`GPT2` is an arrangement of the shared :mod:`attnlab.nn` layers, as
``transformers``' ``GPT2LMHeadModel`` computes it::

    ids (B, T) -> token embedding + learned position embedding
               -> n_layer x pre-norm TransformerBlock (causal, tanh GELU)
               -> LayerNorm -> tied output layer (the token embedding) -> logits (B, T, V)

Its attention is :class:`~attnlab.MultiheadAttention` inside
:class:`~attnlab.nn.TransformerBlock`, so the maps, :meth:`GPT2.trace` and the cache come
from the blocks. :meth:`GPT2.from_pretrained` reads ``config.json`` and
``model.safetensors`` with attnlab's own safetensors reader (no torch, no pickle); the
checkpoint's ``Conv1D`` weights ``(in, out)`` are transposed at load
(:func:`attnlab.io.names.load_transposed`). A ``tokenizer.json`` is read with the
``tokenizers`` library when the folder has one (:meth:`GPT2.generate_text`).

Shapes: ``B`` sequences, ``T`` tokens, ``D = n_embd``, ``H = n_head``, ``V = vocab_size``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from attnlab._validation import float_dtype, generator, positive_int
from attnlab.io import CheckpointError, check_tokenizer, load_tokenizer, read_header, read_json, safetensors_weights
from attnlab.io.checks import check_sizes, check_special_ids
from attnlab.io.files import file_kind
from attnlab.io.names import gpt2_name_map, gpt2_transposed, load_transposed
from attnlab.models.decoder import CausalLM, CausalLMOutput
from attnlab.models.generate import embed_tokens, embed_tokens_backward
from attnlab.nn import init
from attnlab.nn.blocks import TransformerBlock
from attnlab.nn.hooks import HookPoint
from attnlab.nn.layers import Embedding, LayerNorm
from attnlab.nn.module import Module

__all__ = ["GPT2", "GPT2Config", "GPT2Output", "parameter_shapes", "unsupported_setting"]

# transformers' activation names -> attnlab's (``gelu_new`` is GPT-2's tanh approximation).
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class GPT2Config:
    """The architecture of a GPT-2 model (the fields of ``transformers``' ``config.json``).

    Attributes:
        vocab_size: number of token ids ``V``.
        n_positions: the longest sequence (number of position embeddings).
        n_embd: width ``D``; ``n_head`` must divide it.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        n_inner: feed-forward width (None: ``4 * n_embd``).
        activation_function: ``"gelu_new"`` (GPT-2's tanh GELU), ``"gelu_pytorch_tanh"``,
            ``"gelu"`` (exact) or ``"relu"``.
        layer_norm_epsilon: the LayerNorms' ``eps``.
        bos_token_id, eos_token_id: the tokenizer's special ids (kept for the caller;
            :meth:`GPT2.generate` stops only at an ``eos_token_id`` it is given).

    >>> GPT2Config(n_embd=64, n_head=4).d_ff
    256
    >>> GPT2Config(n_embd=64, n_head=5)
    Traceback (most recent call last):
    ...
    ValueError: n_embd=64 must be divisible by n_head=5
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            positive_int(getattr(self, name), name)
        if self.n_inner is not None:
            positive_int(self.n_inner, "n_inner")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"activation_function must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                             f"got {self.activation_function!r}")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"layer_norm_epsilon must be a positive float, got {eps!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None:
                positive_int(value, name, allow_zero=True)

    @property
    def d_ff(self) -> int:
        return 4 * self.n_embd if self.n_inner is None else self.n_inner

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> GPT2Config:
        """Read a ``transformers`` GPT-2 ``config.json``; errors name the file and the field.

        Options attnlab's GPT-2 does not compute are refused: unscaled or layer-scaled
        attention, cross-attention, an output layer not tied to the token embedding.
        """
        path = Path(path)
        data = read_json(path)
        if data.get("model_type") != "gpt2":
            raise CheckpointError(f"{path}: model_type is {data.get('model_type')!r}, but should be 'gpt2' "
                                  "(this is not a GPT-2 checkpoint)")
        problem = unsupported_setting(data)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("bos_token_id", "eos_token_id"):  # a list of ids: the first
            if isinstance(values.get(key), list):
                values[key] = values[key][0] if values[key] else None
        check_sizes(values, path, required=("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"),
                    optional=("n_inner",))
        check_special_ids(values, path)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc


#: ``transformers`` GPT-2 settings attnlab's GPT-2 does not compute, with the value it needs.
UNSUPPORTED = (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
               ("add_cross_attention", False), ("tie_word_embeddings", True))


def unsupported_setting(settings) -> str | None:
    """Why a ``transformers`` GPT-2 config (a ``config.json`` dict, or any object with its
    attributes) cannot be computed by attnlab's GPT-2, or None when it can.

    >>> unsupported_setting({"scale_attn_weights": False})
    "scale_attn_weights=False is not supported (attnlab's GPT-2 needs scale_attn_weights=True)"
    >>> unsupported_setting({"n_layer": 2}) is None
    True
    """
    get = settings.get if isinstance(settings, dict) else lambda key, default: getattr(settings, key, default)
    for key, needed in UNSUPPORTED:
        value = get(key, needed)
        if value != needed:
            return f"{key}={value!r} is not supported (attnlab's GPT-2 needs {key}={needed})"
    return None


#: What :meth:`GPT2.inspect` returns: every decoder's
#: :class:`~attnlab.models.decoder.CausalLMOutput`, under its older name.
GPT2Output = CausalLMOutput


def parameter_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter of a :class:`GPT2` with ``config`` (``state_dict``
    names), computed from the config alone: nothing is allocated.

    >>> shapes = parameter_shapes(GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    >>> shapes["pos_emb.weight"], shapes["blocks.0.mlp.0.weight"]
    ((16, 8), (32, 8))
    """
    V, P, D, F_ = config.vocab_size, config.n_positions, config.n_embd, config.d_ff
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (V, D), "pos_emb.weight": (P, D)}
    for i in range(config.n_layer):
        b = f"blocks.{i}."
        shapes.update({
            b + "ln_1.weight": (D,), b + "ln_1.bias": (D,),
            b + "attn.in_proj_weight": (3 * D, D), b + "attn.in_proj_bias": (3 * D,),
            b + "attn.out_proj.weight": (D, D), b + "attn.out_proj.bias": (D,),
            b + "ln_2.weight": (D,), b + "ln_2.bias": (D,),
            b + "mlp.0.weight": (F_, D), b + "mlp.0.bias": (F_,),
            b + "mlp.2.weight": (D, F_), b + "mlp.2.bias": (D,),
        })
    shapes["ln_f.weight"] = shapes["ln_f.bias"] = (D,)
    return shapes


def _kind(path: Path) -> str:
    try:
        return file_kind(path.stat().st_mode) or "not a regular file"
    except OSError:
        return "unreadable"


def _layers_in(names, prefix: str) -> int:
    found = {int(m.group(1)) for n in names if (m := re.match(re.escape(prefix) + r"h\.(\d+)\.", n))}
    return max(found) + 1 if found else 0


class GPT2(CausalLM):
    """A GPT-2 language model (``transformers``' ``GPT2LMHeadModel``, eval mode).

    Build it with :meth:`from_pretrained` (a checkpoint folder), from a config and a
    ``transformers``-named weights dict (``weights=``, with or without the
    ``transformer.`` prefix), or from a config alone (random weights from ``rng``). It is
    built in eval mode (after :meth:`train`, :meth:`backward` fills every parameter's
    ``.grad``). Parameter names: ``tok_emb.weight``, ``pos_emb.weight``,
    ``blocks.{i}.ln_1.weight``, ``blocks.{i}.attn.in_proj_weight``, …, ``ln_f.bias``; the
    output layer is ``tok_emb.weight`` (tied).

    Args:
        config: the :class:`GPT2Config`.
        weights: tensor name -> array in ``transformers``' names, ``Conv1D`` layout.
        tokenizer: a ``tokenizers.Tokenizer`` for the text methods.
        rng: Generator of the random weights (only without ``weights``).
        dtype: float32 (default) or float64.
        name: a human-readable description.
        attention_fn: passed to every attention layer (a faster kernel).

    >>> cfg = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    >>> model = GPT2(cfg, rng=np.random.default_rng(0))
    >>> model(np.array([[1, 2, 3]])).shape
    (1, 3, 50)
    >>> model.generate(np.array([[1, 2, 3]]), 4).shape
    (1, 7)
    """

    def __init__(
        self,
        config: GPT2Config,
        weights: dict[str, np.ndarray] | None = None,
        tokenizer=None,
        *,
        rng: np.random.Generator | None = None,
        dtype=np.float32,
        name: str | None = None,
        attention_fn=None,
    ) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        c = config
        dtype = float_dtype(dtype)
        object.__setattr__(self, "config", c)
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "name", name or f"GPT-2 ({c.n_layer} layers)")
        rng = generator(rng)
        with init.empty_weights() if weights is not None else contextlib.nullcontext():
            self.tok_emb = Embedding(c.vocab_size, c.n_embd, dtype=dtype, rng=rng)
            self.pos_emb = Embedding(c.n_positions, c.n_embd, dtype=dtype, rng=rng)
            if weights is None:  # GPT-2's N(0, 0.02), not torch's N(0, 1); loaded weights need no draw
                for emb in (self.tok_emb, self.pos_emb):
                    emb.weight.data[...] = init.normal(rng, emb.weight.shape, dtype, std=0.02)
            self.hook_embed = HookPoint()
            self.hook_pos_embed = HookPoint()
            self.blocks = Module()
            for i in range(c.n_layer):
                block = TransformerBlock(
                    c.n_embd, c.n_head, c.d_ff, activation=ACTIVATIONS[c.activation_function], causal=True,
                    norm_first=True, layer_norm_eps=c.layer_norm_epsilon, attention_fn=attention_fn,
                    rng=rng, dtype=dtype,
                )
                setattr(self.blocks, str(i), block)
            self.ln_f = LayerNorm(c.n_embd, c.layer_norm_epsilon, dtype=dtype)
        if weights is not None:
            self.load_state_dict(load_transposed(weights, gpt2_name_map(c.n_layer), self._shapes(),
                                                 gpt2_transposed(c.n_layer), dtype=dtype,
                                                 prefixes=("", "transformer."), what="GPT-2"))
        self.eval()

    _positions_name = "n_positions"

    @staticmethod
    def name_map(config: GPT2Config) -> dict[str, tuple[str, ...]]:
        """attnlab parameter name -> the tensor of ``transformers``' ``GPT2LMHeadModel`` it
        is (:func:`~attnlab.io.names.gpt2_name_map` under ``transformer.``), as
        :meth:`Llama.name_map <attnlab.models.llama.llama_name_map>` lists a Llama's.

        >>> GPT2.name_map(GPT2Config(n_layer=1))["blocks.0.attn.in_proj_weight"]
        ('transformer.h.0.attn.c_attn.weight',)
        """
        return {ours: tuple("transformer." + s for s in src) for ours, src in gpt2_name_map(config.n_layer).items()}

    @staticmethod
    def conv1d_weights(config: GPT2Config) -> frozenset[str]:
        """The parameters ``transformers`` keeps as ``Conv1D`` weights ``(in, out)`` (attnlab
        keeps every weight ``(out, in)``): PEFT's ``fan_in_fan_out`` layers."""
        return gpt2_transposed(config.n_layer)

    def __repr__(self) -> str:
        c = self.config
        return (f"GPT2({self.name!r}, layers={c.n_layer}, heads={c.n_head}, n_embd={c.n_embd}, "
                f"vocab_size={c.vocab_size}, n_positions={c.n_positions}, dtype={self.dtype})")

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: p.shape for n, p in self.named_parameters()}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=np.float32, name: str | None = None) -> GPT2:
        """Load a GPT-2 checkpoint folder: ``config.json``, ``model.safetensors`` and, when
        present, ``tokenizer.json`` (read with the ``tokenizers`` library).

        Nothing is downloaded and pickle files (``pytorch_model.bin``) are never read.
        Every tensor is checked (present, float, the shape the config needs, in the
        ``Conv1D`` layout) before any is read; a ``transformer.`` prefix
        (``GPT2LMHeadModel`` files) is accepted.

        Raises:
            FileNotFoundError: the folder, ``config.json`` or ``model.safetensors`` is missing.
            CheckpointError: a malformed file, an unsupported config, a missing tensor or
                one of the wrong shape or dtype (the message names the file, the tensor
                and the shape found and needed), a folder with only ``pytorch_model.bin``.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder (a GPT-2 checkpoint folder needs "
                                    "config.json and model.safetensors)")
        weights_file = safetensors_weights(folder)
        config = GPT2Config.from_json(folder / "config.json")
        dtype = float_dtype(dtype)
        header = read_header(weights_file)
        prefix = "transformer." if "transformer.wte.weight" in header[0] else ""
        n = _layers_in(header[0], prefix)
        if n and n != config.n_layer:
            raise CheckpointError(f"{folder / 'config.json'}: n_layer is {config.n_layer}, but "
                                  f"{weights_file} holds {n} layers")
        tokenizer_file = folder / "tokenizer.json"
        tokenizer = None
        if tokenizer_file.exists() and not tokenizer_file.is_file():
            warnings.warn(f"{tokenizer_file} is not read: it is {_kind(tokenizer_file)}, not a file; "
                          "the text methods need a tokenizer", stacklevel=2)
        elif tokenizer_file.is_file():
            if importlib.util.find_spec("tokenizers") is None:
                warnings.warn(f"{tokenizer_file} is not read: the tokenizers library is not "
                              "installed (pip install tokenizers); the text methods need it", stacklevel=2)
            else:
                tokenizer = load_tokenizer(tokenizer_file)
                check_tokenizer(tokenizer, config.vocab_size, tokenizer_file)
        c = config
        # Every tensor is checked against the header (the shapes the config asks for) before
        # anything is allocated: a config cannot make attnlab allocate more than the file holds.
        state = load_transposed(
            weights_file, gpt2_name_map(c.n_layer), parameter_shapes(c), gpt2_transposed(c.n_layer),
            dtype=dtype, prefixes=(prefix,), what="GPT-2", header=header,
        )
        with init.empty_weights():
            model = cls(config, tokenizer=tokenizer, dtype=dtype, name=name or folder.name)
        model.load_state_dict(state, assign=True)  # fresh arrays (transposed ones are copied)
        return model

    # ------------------------------------------------------------------ forward

    def _embed(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return embed_tokens(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, ids, positions)

    def _embed_backward(self, grad: np.ndarray) -> None:
        embed_tokens_backward(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, grad)

    @property
    def _out_param(self):
        return self.tok_emb.weight  # tied: the output layer is the token embedding

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes (``n_positions``)."""
        return self.config.n_positions

    @property
    def W_U(self) -> np.ndarray:
        """The unembedding ``(D, V)`` (a view of the tied token embedding): ``logits = h @ W_U``."""
        return self.tok_emb.weight.data.T

    # ------------------------------------------------------------------ generation

    # ------------------------------------------------------------------ text

    def generate_text(
        self,
        prompt: str | Sequence[str],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: np.random.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        cache_dtype=None,
    ) -> str | list[str]:
        """Text in, text out: each prompt and its continuation (up to an ``eos_token_id``,
        which is left out), decoded by the tokenizer. Several prompts run as one
        left-padded batch. The options are :meth:`generate`'s.
        """
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise ValueError("prompt is empty: give a text or a list of texts")
        encoded = [self.encode(p)[0] for p in prompts]
        T = max(len(e) for e in encoded)
        ids = np.zeros((len(encoded), T), dtype=np.int64)
        mask = np.zeros((len(encoded), T), dtype=bool)
        for i, e in enumerate(encoded):
            ids[i, T - len(e) :], mask[i, T - len(e) :] = e, True
        out = self.generate(ids, max_new_tokens, attention_mask=mask, temperature=temperature,
                            top_k=top_k, rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype)
        stop = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
        texts = []
        for row, e in zip(out, encoded, strict=True):
            new = row[T:].tolist()
            end = next((j for j, t in enumerate(new) if t in stop), len(new))
            texts.append(self.tokenizer.decode(e.tolist() + new[:end]))
        return texts[0] if single else texts

    # ------------------------------------------------------------------ inspection
