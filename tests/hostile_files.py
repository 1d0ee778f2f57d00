"""Hostile model files, built from a good one: for the tests (tiny files) and for
``benchmarks/hostile.py`` (the bundled SmolLM2 file). Each builder writes ``dst`` and
returns it; nothing here loads a model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

from gguf_files import DROP, rewrite_gguf

__all__ = ["DROP", "append_tensor", "cut", "field_at", "nested_array", "patch", "rewrite_gguf", "small_vocabulary",
           "tensor_info_at", "write_hf_decoder"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def cut(src, dst, at: int) -> Path:
    """The first ``at`` bytes of ``src``."""
    with open(src, "rb") as f:
        Path(dst).write_bytes(f.read(at))
    return Path(dst)


def patch(src, dst, offset: int, fmt: str, value) -> Path:
    """A copy of ``src`` with ``struct.pack(fmt, value)`` written at ``offset``."""
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))
    return Path(dst)


def field_at(path, key: str) -> tuple[int, int]:
    """``(offset, size)`` in bytes of the metadata entry ``key`` (key length to the end of its value)."""
    import gguf

    f = gguf.GGUFReader(path).fields[key]
    return f.offset, sum(int(p.nbytes) for p in f.parts)


def tensor_info_at(path, which: int | str = 0) -> dict:
    """Where the parts of a tensor's header entry lie (``which``: its index or name): its
    name, ``n_dims`` (u32), ``dims`` (u64 each), ``type`` (u32) and ``offset`` (u64), as byte
    offsets in the file."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    t = tensors[which] if isinstance(which, int) else next(t for t in tensors if t.name == which)
    at = t.field.offset
    sizes = [int(p.nbytes) for p in t.field.parts]  # name length, name, n_dims, dims, type, offset
    starts = np.cumsum([0, *sizes])
    return {"name": t.name, "n_dims": at + int(starts[2]), "dims": at + int(starts[3]), "ndim": len(t.shape),
            "type": at + int(starts[4]), "offset": at + int(starts[5])}


def append_tensor(path, name: str, shape: list[int]) -> None:
    """A tensor of no bytes, of ``shape``, added to a safetensors file's header."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def nested_array(src, dst, depth: int) -> Path:
    """``src`` with one more metadata entry: an array of arrays ``depth`` deep (one byte at the
    bottom), padded to the file's alignment so that the tensors stay where they are."""
    import gguf

    reader = gguf.GGUFReader(src)
    data = Path(src).read_bytes()
    align = int(reader.fields["general.alignment"].contents()) if "general.alignment" in reader.fields else 32
    last = list(reader.fields.values())[-1]
    end = last.offset + sum(int(p.nbytes) for p in last.parts)
    A, U8 = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.UINT8)
    body = struct.pack("<I", A) + struct.pack("<IQ", A, 1) * (depth - 1) + struct.pack("<IQB", U8, 1, 7)
    key = b"test.nested"
    key += b"x" * (-(8 + len(key) + len(body)) % align)
    entry = struct.pack("<Q", len(key)) + key + body
    count = struct.unpack_from("<Q", data, 16)[0]
    Path(dst).write_bytes(data[:16] + struct.pack("<Q", count + 1) + data[24:end] + entry + data[end:])
    return Path(dst)


def small_vocabulary(src, dst, n: int) -> Path:
    """``src`` with its vocabulary cut to the first ``n`` tokens (their types and scores too,
    and the merges whose parts and result are among them): a vocabulary shorter than the
    embedding, with nothing else wrong."""
    import gguf

    reader = gguf.GGUFReader(src)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:n]
    keep = set(tokens)
    changes: dict = {"tokenizer.ggml.tokens": tokens}
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in reader.fields:
            f = reader.fields[key]
            changes[key] = (f.contents()[:n], gguf.GGUFValueType.ARRAY, f.types[-1])
    if "tokenizer.ggml.merges" in reader.fields:
        merges = [m for m in reader.fields["tokenizer.ggml.merges"].contents()
                  if all(p in keep for p in m.split(" ", 1)) and m.replace(" ", "", 1) in keep]
        changes["tokenizer.ggml.merges"] = merges or DROP  # the writer writes no empty array
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        if f"tokenizer.ggml.{key}" in reader.fields and reader.fields[f"tokenizer.ggml.{key}"].contents() >= n:
            changes[f"tokenizer.ggml.{key}"] = DROP
    return rewrite_gguf(src, dst, metadata=changes)


def write_hf_decoder(folder, *, model_type: str = "llama", layers: int = 2, hidden: int = 32, heads: int = 4,
                     kv_heads: int = 2, ff: int = 64, head_size: int | None = None, seed: int = 0,
                     tokenizer: bool = True, tensors: dict | None = None, **changes) -> Path:
    """A random decoder folder in ``transformers``' names, written without torch:
    ``config.json`` (``changes`` applied after the weights are made: the config may then
    disagree with them), ``model.safetensors`` (``tensors``: name -> array or ``DROP``,
    applied last) and a byte-level ``tokenizer.json`` of 300 tokens."""
    from attnlab.io import save_tensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    V, D, F, Dh = 300, hidden, ff, head_size or hidden // heads
    gemma = model_type.startswith("gemma")
    bias = model_type == "qwen2"
    qk_norm = model_type in ("qwen3", "gemma3_text")
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not gemma:
        shapes["lm_head.weight"] = (V, D)
    for i in range(layers):
        h = f"model.layers.{i}."
        a = h + "self_attn."
        shapes.update({h + "input_layernorm.weight": (D,), h + "post_attention_layernorm.weight": (D,),
                       a + "q_proj.weight": (heads * Dh, D), a + "k_proj.weight": (kv_heads * Dh, D),
                       a + "v_proj.weight": (kv_heads * Dh, D), a + "o_proj.weight": (D, heads * Dh),
                       h + "mlp.gate_proj.weight": (F, D), h + "mlp.up_proj.weight": (F, D),
                       h + "mlp.down_proj.weight": (D, F)})
        if bias:
            shapes.update({a + "q_proj.bias": (heads * Dh,), a + "k_proj.bias": (kv_heads * Dh,),
                           a + "v_proj.bias": (kv_heads * Dh,)})
        if qk_norm:
            shapes.update({a + "q_norm.weight": (Dh,), a + "k_norm.weight": (Dh,)})
        if gemma:
            shapes.update({h + "pre_feedforward_layernorm.weight": (D,), h + "post_feedforward_layernorm.weight": (D,)})
    weights = {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in shapes.items()}
    for name, value in (tensors or {}).items():
        if value is DROP:
            weights.pop(name, None)
        else:
            weights[name] = value
    save_tensors(folder / "model.safetensors", weights)
    config = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], "vocab_size": V,
              "hidden_size": D, "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": gemma, "bos_token_id": 0, "eos_token_id": 0}
    if head_size is not None or gemma:
        config["head_dim"] = Dh
    if gemma:
        config.update(query_pre_attn_scalar=Dh, sliding_window=8)
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        from helpers import byte_bpe_tokenizer

        byte_bpe_tokenizer(folder / "tokenizer.json", vocab_size=V)
    return folder
