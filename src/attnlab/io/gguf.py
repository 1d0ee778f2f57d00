"""GGUF files (llama.cpp's format), read through the ``gguf`` package (the ``gguf`` extra).

:func:`read_gguf` returns the file's metadata, a transformers-like config dict, the tensors
under transformers' names dequantized to float32, a ``tokenizers`` tokenizer built from the
file's vocabulary (byte-level BPE, or sentencepiece BPE with byte fallback) and merges, and
the chat template. Supported architectures: ``llama``
(SmolLM2, Llama 2 and 3, Mistral), ``mistral``, ``qwen2`` and ``qwen3``.

Conventions undone at load, as transformers' GGUF loader does:

- llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` of the ``llama``
  architecture so that its kernels rotate interleaved pairs: within each head the rows of
  the two halves ``(h1, h2)`` are stored interleaved ``(h1[0], h2[0], h1[1], ...)``.
  :func:`unpermute_qk_rows` puts them back in halves (Hugging Face's rotary layout).
- GGUF lists a tensor's dims fastest-first; the ``gguf`` package gives NumPy's order, which
  is torch's ``(out_features, in_features)``.

A GGUF file is untrusted input: every read the ``gguf`` reader makes is checked against the
file's size, and counts in the header (tensors, metadata entries, array lengths, string
lengths, tensor offsets) that claim more than the file holds are refused with a
:class:`~attnlab.io.CheckpointError` naming the file before anything is allocated for them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attnlab.io.files import CheckpointError, regular_file

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUFFile",
    "gguf_config",
    "gguf_name",
    "gguf_tokenizer",
    "read_gguf",
    "unpermute_qk_rows",
]

# GGUF architecture -> transformers' class name
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED = ("llama", "mistral")

# metadata key (after "<arch>.") -> config key
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}

# per-block GGUF name -> transformers name (after "model.layers.{i}.")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` (how the vocabulary's merges were learned);
# any other value splits as GPT-2 does (the ByteLevel pre-tokenizer's own regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


@dataclass
class GGUFFile:
    """What :func:`read_gguf` read.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (``"llama"``, ``"qwen2"``, ...).
        metadata: every metadata entry, key -> Python value (lists for arrays).
        config: a transformers-like ``config.json`` dict (``model_type``, ``architectures``,
            ``hidden_size``, ``num_key_value_heads``, ``rope_theta``, ``tie_word_embeddings``…).
        tensors: transformers name -> float32 array (empty with ``tensors=False``), or
            :class:`attnlab.quant.QuantizedTensor` for tensors kept quantized.
        skipped: GGUF tensors with no transformers counterpart (e.g. ``rope_freqs.weight``).
        chat_template: the Jinja chat template, or ``None``.
    """

    path: Path
    architecture: str
    metadata: dict
    config: dict
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    chat_template: str | None = None
    _tokenizer: object = field(default=None, repr=False, compare=False)

    def tokenizer(self):
        """A ``tokenizers.Tokenizer`` built from the file's vocabulary (see :func:`gguf_tokenizer`)."""
        if self._tokenizer is None:
            self._tokenizer = gguf_tokenizer(self.metadata, where=self.path)
        return self._tokenizer


def gguf_name(name: str) -> str | None:
    """The transformers name of a GGUF tensor name, or ``None`` if it has none.

    >>> gguf_name("blk.3.attn_q.weight"), gguf_name("token_embd.weight"), gguf_name("rope_freqs.weight")
    ('model.layers.3.self_attn.q_proj.weight', 'model.embed_tokens.weight', None)
    """
    m = _BLOCK_RE.fullmatch(name)
    if m:
        part = _BLOCK_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    top = _TOP_NAMES.get(stem)
    return None if top is None or kind not in ("weight", "bias") else f"{top}.{kind}"


def _file_name(hf: str) -> str:
    """The GGUF name of a transformers name :func:`gguf_name` maps (else ``hf`` itself)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    if m:
        part = next((g for g, h in _BLOCK_NAMES.items() if h == m.group(2)), None)
        return hf if part is None else f"blk.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, kind = hf.rpartition(".")
    top = next((g for g, h in _TOP_NAMES.items() if h == stem), None)
    return hf if top is None else f"{top}.{kind}"


def unpermute_qk_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, interleaved pairs back to two halves.

    ``w`` is ``(n_heads * D, ...)`` (a weight or a bias); llama.cpp stored row ``2 f + s`` of a
    head at the place of row ``s * D/2 + f`` (``s`` in {0, 1}, ``f < D/2``).

    >>> unpermute_qk_rows(np.array([0, 10, 1, 11]), 1)
    array([ 0,  1, 10, 11])
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"a q/k weight with {rows} rows cannot hold {n_heads} heads of even size")
    half = rows // n_heads // 2
    # (heads, D/2, 2, ...) -> (heads, 2, D/2, ...)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _reader_class():
    """``gguf.GGUFReader`` with every read checked against the file's size, and counts
    checked against the bytes left before a loop runs over them."""
    from gguf import GGUFReader, GGUFValueType

    sizes: dict = {}

    class CheckedReader(GGUFReader):
        # The reader slices its np.memmap some 800 000 times for a 49k-token vocabulary;
        # a plain ndarray view of the same mapping slices several times faster (memmap's
        # __array_finalize__ runs on every slice). The mapping stays open through its base.
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _left(self, offset: int) -> int:
            return len(self.data) - int(offset)

        def _get(self, offset, dtype, count=1, override_order=None):
            itemsize = sizes.get(dtype)
            if itemsize is None:
                itemsize = sizes[dtype] = np.dtype(dtype).itemsize
            offset, count = int(offset), int(count)
            if count < 0 or offset < 0 or offset + itemsize * count > self.data.shape[0]:
                raise _Truncated(f"it claims {count} item(s) of {np.dtype(dtype).name} at byte {offset}, "
                                 f"past the end of the file ({len(self.data)} bytes)")
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs, count):
            # a metadata entry is at least a key length, a type and one byte of value
            if int(count) * 13 > self._left(offs):
                raise _Truncated(f"its header claims {int(count)} metadata entries; the file holds "
                                 f"at most {self._left(offs) // 13}")
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            # a tensor's entry is at least a name length, a dim count, a type and an offset
            if int(count) * 24 > self._left(offs):
                raise _Truncated(f"its header claims {int(count)} tensors; the file holds at most "
                                 f"{self._left(offs) // 24}")
            return super()._build_tensor_info(offs, count)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == GGUFValueType.ARRAY:
                item_type = int(self._get(orig_offs, np.uint32)[0])
                n = int(self._get(orig_offs + 4, np.uint64)[0])
                try:
                    kind = GGUFValueType(item_type)
                except ValueError:
                    raise _Truncated(f"an array at byte {orig_offs} has unknown item type {item_type}") from None
                if kind == GGUFValueType.ARRAY:  # as llama.cpp: metadata arrays are flat
                    raise _Truncated(f"an array at byte {orig_offs} holds arrays; GGUF metadata arrays are flat")
                nptype = self.gguf_scalar_to_np.get(kind)
                least = np.dtype(nptype).itemsize if nptype is not None else 8 if kind == GGUFValueType.STRING else 12
                if n * least > self._left(orig_offs + 12):
                    raise _Truncated(f"an array at byte {orig_offs} claims {n} items; the file holds at most "
                                     f"{self._left(orig_offs + 12) // least}")
                if nptype is not None:
                    return self._scalar_array(orig_offs, kind, nptype, n)
                if kind == GGUFValueType.STRING and self.byte_order == "I":
                    return self._string_array(orig_offs, n)
            return super()._get_field_parts(orig_offs, raw_type)

        # The reader parses an array item by item (a recursive call, an enum and NumPy
        # views each): SmolLM2's vocabulary (49152 tokens, their types and 48900 merges)
        # took 2.0 s. Arrays of numbers are read as one view here, arrays of strings in one
        # loop over the bytes, and their fields give the same lists (``contents()``): the
        # whole metadata in 0.09 s, and load_smollm2() in 1.3 s against 3.0 s.
        def _array_head(self, orig_offs):
            """The parts of an array's item type and count, as the reader gives them."""
            return [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]

        def _scalar_array(self, orig_offs, kind, nptype, n):
            values = self._get(orig_offs + 12, nptype, n)
            return 12 + int(values.nbytes), [*self._array_head(orig_offs), values], [2], [GGUFValueType.ARRAY, kind]

        def _string_array(self, orig_offs, n):
            head = self._array_head(orig_offs)
            data, end = self.data, len(self.data)
            raw = memoryview(data)
            unpack = struct.Struct("=Q").unpack_from
            parts, at = [], orig_offs + 12
            for _ in range(n):
                if at + 8 > end:
                    raise _Truncated(f"a string's length at byte {at} is past the end of the file ({end} bytes)")
                (size,) = unpack(raw, at)
                at += 8
                if size > end - at:
                    raise _Truncated(f"it claims a string of {size} bytes at byte {at}, past the end of the file "
                                     f"({end} bytes)")
                parts.append(data[at:at + size])
                at += size
            return at - orig_offs, [*head, *parts], list(range(2, 2 + n)), [GGUFValueType.ARRAY, GGUFValueType.STRING]

    return CheckedReader


class _Truncated(ValueError):
    """A read past the end of the file (raised inside the reader, reported with the path)."""


def _open(path: Path):
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("reading GGUF files needs the gguf package: pip install 'attnlab[gguf]'") from None
    try:
        return _reader_class()(path)
    except _Truncated as exc:
        raise CheckpointError(f"{path} is truncated or corrupt: {exc}") from exc
    except (ValueError, KeyError, IndexError, ArithmeticError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not a valid GGUF file: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc.strerror or exc}") from exc


def _metadata(reader, path: Path) -> dict:
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = f.contents()
        except (ValueError, UnicodeDecodeError, IndexError, TypeError, RecursionError) as exc:
            raise CheckpointError(f"{path}: metadata entry {key!r} cannot be read: {exc}") from exc
    return out


def gguf_config(metadata: dict, tensor_names, *, where: object = "the GGUF file") -> dict:
    """A transformers-like config dict from a GGUF file's metadata and tensor names (or a
    mapping of names to shapes: then a file without ``vocab_size`` or a vocabulary takes its
    embedding's rows).

    The values are the metadata's as they are; :func:`attnlab.io.checks.check_decoder_config`
    checks them.

    Raises:
        CheckpointError: an architecture attnlab does not read (the supported ones listed),
            a required entry missing or not a positive integer, a special token id that is
            not an integer.
    """
    from attnlab.io.checks import check_sizes

    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{where}: GGUF architecture {arch!r:.60} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")
    names = set(tensor_names)
    config: dict = {"model_type": arch, "architectures": [GGUF_ARCHITECTURES[arch]]}
    for key, target in _CONFIG_KEYS.items():
        if f"{arch}.{key}" in metadata:
            config[target] = metadata[f"{arch}.{key}"]
    for needed in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if needed not in config:
            raise CheckpointError(f"{where}: the metadata has no {needed} ({arch}.* entry)")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    check_sizes(config, where, required=("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "intermediate_size", "num_key_value_heads"),
                optional=("max_position_embeddings", "vocab_size"))
    if f"{arch}.attention.key_length" in metadata:
        config["head_dim"] = metadata[f"{arch}.attention.key_length"]
    elif arch in _PERMUTED and f"{arch}.rope.dimension_count" in metadata:
        config["head_dim"] = metadata[f"{arch}.rope.dimension_count"]
    else:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind}
        if f"{arch}.rope.scaling.factor" in metadata:
            scaling["factor"] = metadata[f"{arch}.rope.scaling.factor"]
        if f"{arch}.rope.scaling.original_context_length" in metadata:
            scaling["original_max_position_embeddings"] = metadata[f"{arch}.rope.scaling.original_context_length"]
        config["rope_scaling"] = scaling
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):
        config["vocab_size"] = len(tokens)
    embedding = tensor_names.get("token_embd.weight") if isinstance(tensor_names, dict) else None
    if "vocab_size" not in config and embedding is not None and len(embedding) == 2:
        config["vocab_size"] = int(embedding[0])
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    for key, target in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in metadata:
            value = metadata[f"tokenizer.ggml.{key}"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(f"{where}: tokenizer.ggml.{key} must be a token id (an integer >= 0), "
                                      f"got {value!r:.60}")
            config[target] = value
    return config


def _check_tensors(reader, metadata: dict, config: dict, path: Path) -> None:
    """Everything the header says about the tensors, checked before one is read: types
    attnlab dequantizes, the names and shapes the config needs (:func:`attnlab.io.checks.check_decoder_tensors`),
    and a vocabulary of one token per embedding row (as llama.cpp asks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits

    from attnlab.io.checks import check_decoder_tensors

    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    shapes = {}
    for t in reader.tensors:
        hf = gguf_name(t.name)
        if hf is None:
            continue
        if t.tensor_type not in readable:
            raise CheckpointError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, a type attnlab cannot "
                f"dequantize; supported: {', '.join(sorted(q.name for q in readable))}")
        shapes[hf] = tuple(int(d) for d in reversed(t.shape.tolist()))
    check_decoder_tensors(config, shapes, path, file_name=_file_name)
    tokens = metadata.get("tokenizer.ggml.tokens")
    rows = shapes["model.embed_tokens.weight"][0]
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != rows):
        got = f"{len(tokens):,} tokens" if isinstance(tokens, list) else f"a {type(tokens).__name__}"
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens holds {got}, but token_embd.weight has {rows:,} rows "
                              "(one token per row)")


def read_gguf(path: str | os.PathLike, *, tensors: bool = True, quantized: bool | None = None) -> GGUFFile:
    """Read a GGUF file: metadata, config, tensors (dequantized to float32 under transformers'
    names, q/k rows back in halves), tokenizer and chat template.

    The header is checked before any tensor is read (see :mod:`attnlab.io.checks`): the
    config's sizes, head arithmetic and rotary values; with ``tensors``, the types, names
    and shapes of the tensors, one vocabulary token per embedding row, and the vocabulary
    and merges as a tokenizer. The tensors are then read and must hold finite numbers within
    :data:`~attnlab.io.checks.MAX_WEIGHT`.

    Args:
        path: the ``.gguf`` file.
        tensors: read and dequantize the tensors (``False``: metadata and config only).
        quantized: keep 2-D ``Q8_0``, ``Q4_0`` and ``Q4_1`` tensors quantized, as
            :class:`attnlab.quant.QuantizedTensor` (their blocks checked against their
            shape); other types are dequantized as without it (``None``: False). Where
            the compiled kernels are missing (no numba), everything is dequantized, with
            one warning (:func:`attnlab.quant.keeps_quantized`).

    Raises:
        FileNotFoundError: no file there.
        CheckpointError: naming the file: not GGUF, truncated, a header that claims more
            than the file holds, an unsupported architecture, quantization type or tokenizer
            (named), a config the tensors do not fit, tensors of the wrong shape, NaN,
            infinite or huge weights (see :func:`attnlab.io.checks.check_weights`). Nothing
            is returned half-read.
        ImportError: the ``gguf`` package is missing.
    """
    from attnlab.io.checks import check_decoder_config, check_weights

    path = regular_file(path, "GGUF file")
    reader = _open(path)
    metadata = _metadata(reader, path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    config = gguf_config(metadata, shapes, where=path)
    check_decoder_config(config, path)
    arch = metadata["general.architecture"]
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: tokenizer.chat_template must be a string, got a {type(template).__name__}")
    out = GGUFFile(path=path, architecture=arch, metadata=metadata, config=config, chat_template=template)
    if not tensors:
        return out
    _check_tensors(reader, metadata, config, path)
    if "tokenizer.ggml.tokens" in metadata and importlib.util.find_spec("tokenizers") is not None:
        out._tokenizer = gguf_tokenizer(metadata, where=path)  # a bad vocabulary is refused before the tensors
    from gguf.quants import dequantize

    from attnlab.quant import KINDS, QuantizedTensor

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if quantized:  # without the compiled kernels, float32 is the faster way (one warning)
        from attnlab.quant import keeps_quantized

        quantized = keeps_quantized()
    for t in reader.tensors:
        hf = gguf_name(t.name)
        if hf is None:
            out.skipped.append(t.name)
            continue
        shape = shapes[t.name]
        if quantized and t.tensor_type.name in KINDS and len(shape) == 2:
            try:
                q = QuantizedTensor.from_bytes(t.data, t.tensor_type.name, shape, name=t.name)
            except ValueError as exc:
                raise CheckpointError(f"{path}: {exc}") from exc
            # the largest weight a block can hold: its scale times the largest code, plus its min
            top = np.abs(q.scales) * {"Q8_0": 128, "Q4_0": 8, "Q4_1": 15}[q.kind]
            check_weights(top if q.mins is None else top + np.abs(q.mins), t.name, path)
            if arch in _PERMUTED and (".attn_q." in t.name or ".attn_k." in t.name):
                try:
                    order = unpermute_qk_rows(np.arange(shape[0]), heads if ".attn_q." in t.name else kv_heads)
                except ValueError as exc:
                    raise CheckpointError(f"{path}: tensor {t.name} {shape}: {exc}") from exc
                q = q.take_rows(order)
            out.tensors[hf] = q
            continue
        try:
            w = dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError, TypeError, IndexError) as exc:
            raise CheckpointError(f"{path}: tensor {t.name} cannot be dequantized: {exc}") from exc
        if w.shape != shape:
            raise CheckpointError(f"{path}: tensor {t.name} dequantized to {w.shape}, but its header says {shape}")
        check_weights(w, t.name, path)
        if arch in _PERMUTED and (".attn_q." in t.name or ".attn_k." in t.name):
            try:
                w = unpermute_qk_rows(w, heads if ".attn_q." in t.name else kv_heads)
            except ValueError as exc:
                raise CheckpointError(f"{path}: tensor {t.name} {shape}: {exc}") from exc
        if len(shape) == 2 and shape[0] == 1 and t.name.endswith("norm.weight"):
            w = w.reshape(-1)
        if not (w.dtype == np.float32 and w.flags.c_contiguous and w.flags.writeable and w.flags.owndata):
            w = np.array(w, dtype=np.float32, order="C", copy=True)  # a view of the file: own a copy
        out.tensors[hf] = w
    return out


def gguf_tokenizer(metadata: dict, *, where: object = "the GGUF file"):
    """A ``tokenizers.Tokenizer`` from a GGUF file's vocabulary, as transformers builds it.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen): the file's
    tokens and merges, GPT-2's byte-level pre-tokenizer and decoder (or the split regex its
    ``tokenizer.ggml.pre`` names, for Llama 3 and Qwen 2), control tokens as special tokens
    and user-defined ones as added tokens. No BOS is added. Sentencepiece BPE (``"llama"``):
    see :func:`_sentencepiece_tokenizer`.

    Raises:
        CheckpointError: naming the file and the entry: another tokenizer model (``bert``,
            ``t5``, ...), no vocabulary, entries of the wrong kind (a merge without a space,
            a special token id outside the vocabulary), or a vocabulary and merges that do
            not make a tokenizer (a merge of a token outside the vocabulary).
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{where} has no tokenizer (no tokenizer.ggml.tokens entry)")
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"{where}: tokenizer model {model!r:.60} (tokenizer.ggml.model) is not supported; "
                              "supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece BPE)")
    _check_vocabulary(metadata, where)
    try:
        return (_sentencepiece_tokenizer if model == "llama" else _byte_level_tokenizer)(metadata, where)
    except CheckpointError:
        raise
    except Exception as exc:  # the tokenizers library raises bare Exceptions and TypeErrors
        raise CheckpointError(f"{where}: the vocabulary (tokenizer.ggml.tokens, tokenizer.ggml.merges) does not "
                              f"make a tokenizer: {exc}") from exc


def _check_vocabulary(metadata: dict, where) -> None:
    """The ``tokenizer.ggml.*`` entries are of the kinds a tokenizer is built from."""
    tokens = metadata["tokenizer.ggml.tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens must be a non-empty array of strings")
    merges = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list):
        raise CheckpointError(f"{where}: tokenizer.ggml.merges must be an array of strings")
    for i, m in enumerate(merges):
        if not isinstance(m, str) or any(not part for part in m.split(" ", 1)) or " " not in m:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{i}] is {m!r:.60}, but a merge is two tokens "
                                  "separated by a space")
    for key, kinds in (("tokenizer.ggml.token_type", (int,)), ("tokenizer.ggml.scores", (int, float))):
        values = metadata.get(key)
        if values is not None and (not isinstance(values, list) or len(values) != len(tokens)
                                   or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in values)):
            raise CheckpointError(f"{where}: {key} must be an array of {len(tokens):,} numbers, one per token")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < len(tokens)):
            raise CheckpointError(f"{where}: tokenizer.ggml.{key} must be a token id in [0, {len(tokens)}), "
                                  f"got {value!r:.60}")


def _byte_level_tokenizer(metadata: dict, where):
    """Byte-level BPE (see :func:`gguf_tokenizer`)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):  # tokens outside the byte alphabet: spell them in it
        spelled = tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or ()
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
               if k == _CONTROL and set(t) <= letters]
    if special:
        tokenizer.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
            if k == _USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)
    return tokenizer


def _sentencepiece_tokenizer(metadata: dict, where):
    """Sentencepiece BPE (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, TinyLlama)
    as transformers rebuilds it from a GGUF file: the file's pieces with byte fallback,
    merges from the file or recovered from the pieces' scores (every split of a piece into
    two pieces, the best-scoring piece's first), ``▁`` for spaces and one before the text,
    control tokens special, and a BOS token first unless ``tokenizer.ggml.add_bos_token``
    says otherwise."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = list(metadata["tokenizer.ggml.tokens"])
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError(f"{where}: a sentencepiece vocabulary needs merges or one score per token")
        found = []
        for tok, score in zip(tokens, scores, strict=True):  # every split into two known pieces, by the pieces' ids
            pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
            pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
            found.extend((left, right, float(score)) for left, right in pairs)
        found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # best score first (a stable sort)
        merges = [(left, right) for left, right, _ in found]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    types = metadata.get("tokenizer.ggml.token_type") or ()
    special = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types, strict=False) if k == _CONTROL]
    if special:
        tokenizer.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
            if k == _USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens(user)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", True) and bos is not None and 0 <= int(bos) < len(tokens):
        name = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 {name}:1 $B:1", special_tokens=[(name, int(bos))])
    return tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
