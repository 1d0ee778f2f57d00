"""Tiny GGUF files for tests, written with the gguf package's writer: a random Llama-family
model in llama.cpp's layout (q/k rows permuted for ``llama``), a byte-level vocabulary."""

from __future__ import annotations

import numpy as np

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet():
    from attnlab.io.gguf import _byte_alphabet

    return [_byte_alphabet()[b] for b in range(256)]


def permute_qk_rows(w, n_heads):
    """llama.cpp's order: per head, the two halves' rows interleaved (the inverse of
    attnlab.io.gguf.unpermute_qk_rows, written independently)."""
    out = np.empty_like(w)
    D = w.shape[0] // n_heads
    for h in range(n_heads):
        for f in range(D // 2):
            out[h * D + 2 * f] = w[h * D + f]
            out[h * D + 2 * f + 1] = w[h * D + D // 2 + f]
    return out


def write_tiny_gguf(path, *, arch="llama", hidden=32, heads=4, kv_heads=2, layers=2, ff=64, seed=0,
                    qtype="Q8_0", tied=True, bias=False, qk_norm=False, name="tiny"):
    """A random model as a GGUF file; returns the transformers-named float32 weights written
    (before quantization) and the metadata used."""
    import gguf

    rng = np.random.default_rng(seed)
    D = hidden // heads
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_alphabet(), "he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(128)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D)
    if arch == "qwen3":
        w.add_key_length(D)
        w.add_value_length(D)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    weights = {}

    def put(gname, hname, shape, *, quantize=True, permute=None, scale=0.3):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if hname.endswith("norm.weight"):
            x += 1.0
        weights[hname] = x
        stored = permute_qk_rows(x, permute) if permute and arch == "llama" else x
        if quantize and len(shape) == 2 and qtype != "F32":
            q = getattr(gguf.GGMLQuantizationType, qtype)
            if qtype == "F16":
                w.add_tensor(gname, stored.astype(np.float16))
            else:
                w.add_tensor(gname, gguf.quants.quantize(stored, q), raw_dtype=q)
        else:
            w.add_tensor(gname, stored)

    put("token_embd.weight", "model.embed_tokens.weight", (V, hidden))
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        put(b + "attn_norm.weight", h + "input_layernorm.weight", (hidden,), scale=0.1)
        put(b + "attn_q.weight", h + "self_attn.q_proj.weight", (heads * D, hidden), permute=heads)
        put(b + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * D, hidden), permute=kv_heads)
        put(b + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * D, hidden))
        if bias:
            put(b + "attn_q.bias", h + "self_attn.q_proj.bias", (heads * D,), permute=heads)
            put(b + "attn_k.bias", h + "self_attn.k_proj.bias", (kv_heads * D,), permute=kv_heads)
            put(b + "attn_v.bias", h + "self_attn.v_proj.bias", (kv_heads * D,))
        if qk_norm:
            put(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", (D,), scale=0.1)
            put(b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", (D,), scale=0.1)
        put(b + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * D))
        put(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (hidden,), scale=0.1)
        put(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ff, hidden))
        put(b + "ffn_up.weight", h + "mlp.up_proj.weight", (ff, hidden))
        put(b + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, ff))
    put("output_norm.weight", "model.norm.weight", (hidden,), scale=0.1)
    if not tied:
        put("output.weight", "lm_head.weight", (V, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


DROP = object()  # rewrite_gguf: remove this metadata entry or tensor


def _value_type(value):
    """The GGUF type of a Python value (ints: the narrowest unsigned or signed type that holds them)."""
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        return T.BOOL, None
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return T.UINT32, None
        return (T.UINT64 if value >= 0 else T.INT64), None
    if isinstance(value, float):
        return T.FLOAT32, None
    if isinstance(value, str):
        return T.STRING, None
    if isinstance(value, list):
        return T.ARRAY, _value_type(value[0])[0] if value else T.UINT32
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def rewrite_gguf(src, dst, *, metadata=None, tensors=None, arch=None):
    """Copy the GGUF file ``src`` to ``dst`` with changes, the tensors' bytes as they are.

    Args:
        metadata: key -> new value (its GGUF type inferred from the value, or given as
            ``(value, GGUFValueType[, item type])``), or ``DROP``; new keys are added.
        tensors: tensor name -> new name, or ``DROP``.
        arch: a new ``general.architecture``.
    """
    import gguf

    metadata, tensors = dict(metadata or {}), dict(tensors or {})
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch or reader.fields["general.architecture"].contents())
    seen = set()
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        seen.add(name)
        if name in metadata:
            change = metadata[name]
            if change is DROP:
                continue
            value, kind, sub = change if isinstance(change, tuple) else (change, *_value_type(change))
            w.add_key_value(name, value, kind, sub_type=sub)
            continue
        kind = field.types[0]
        w.add_key_value(name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, change in metadata.items():
        if name not in seen and change is not DROP:
            value, kind, sub = change if isinstance(change, tuple) else (change, *_value_type(change))
            w.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        new = tensors.get(t.name, t.name)
        if new is DROP:
            continue
        raw = None if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else t.tensor_type
        w.add_tensor(new, np.asarray(t.data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
