"""Checks of an untrusted model from its header and config, before any tensor is read or any
block is built: one :class:`~attnlab.io.CheckpointError` naming the file and the key.

- **Sizes** (layers, heads, widths, vocabulary, positions) are positive integers under the
  ceilings of :data:`CEILINGS`, far above any released model's, so that a config cannot make
  attnlab build a billion blocks or allocate petabytes; and every size that shapes a tensor
  must equal that tensor's dimension in the file (:func:`check_decoder_tensors`), so a
  config cannot claim more than the file holds.
- **Head arithmetic**: the query heads a multiple of the key/value heads; the width a
  multiple of the heads unless ``head_dim`` is given.
- **Rotary values** (``rope_theta``, ``rope_scaling``) as :class:`~attnlab.core.rotary.RopeConfig`
  accepts them: finite, positive factors.
- **Special token ids**: integers >= 0 (a list of them for ``eos_token_id``).
- **The tensors a decoder needs**, present and of the shapes the config gives them.
- **Weights**, once read: finite and within :data:`MAX_WEIGHT` (:func:`check_weights`).

>>> check_decoder_config({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
...                       "num_hidden_layers": 10**9, "num_attention_heads": 2}, "config.json")
Traceback (most recent call last):
...
attnlab.io.files.CheckpointError: config.json: num_hidden_layers is 1,000,000,000, more than the 1,024 attnlab reads
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping

from attnlab.io.files import CheckpointError

__all__ = ["CEILINGS", "MAX_WEIGHT", "check_decoder_config", "check_decoder_tensors", "check_sizes",
           "check_special_ids", "check_weights", "decoder_tensor_shape"]

MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_WIDTH = 1 << 17
MAX_FEED_FORWARD = 1 << 20
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24

#: The largest value attnlab accepts for each size a config gives (transformers' and GPT-2's
#: names). Released models stay far below: Llama 3.1 405B has 126 layers, 128 heads, a width
#: of 16,384 and a feed-forward width of 53,248; Gemma 3 a vocabulary of 262,144.
CEILINGS = {
    "num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS,
    "num_attention_heads": MAX_HEADS, "num_key_value_heads": MAX_HEADS, "n_head": MAX_HEADS,
    "hidden_size": MAX_WIDTH, "n_embd": MAX_WIDTH, "head_dim": MAX_WIDTH,
    "intermediate_size": MAX_FEED_FORWARD, "n_inner": MAX_FEED_FORWARD,
    "vocab_size": MAX_VOCAB, "type_vocab_size": MAX_VOCAB,
    "max_position_embeddings": MAX_POSITIONS, "n_positions": MAX_POSITIONS, "sliding_window": MAX_POSITIONS,
}

#: The largest weight magnitude a loaded model may hold: float16's largest number. No released
#: model's weights come near it, and a larger one (a corrupt exponent, a forged scale)
#: overflows float32 activations into NaN logits.
MAX_WEIGHT = 65504.0

_DECODER_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_sizes(config: Mapping, where, *, required: Iterable[str] = (), optional: Iterable[str] = ()) -> None:
    """Each of ``required`` (and each of ``optional`` that is there and not null) is a
    positive integer no larger than its ceiling in :data:`CEILINGS`.

    Raises:
        CheckpointError: naming ``where``, the key and the value.
    """
    required = tuple(required)
    missing = [k for k in required if config.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in (*required, *optional):
        value = config.get(key)
        if value is None:
            continue
        if not _is_int(value) or value <= 0:
            raise CheckpointError(f"{where}: {key} must be a positive integer, got {value!r:.60}")
        ceiling = CEILINGS.get(key)
        if ceiling is not None and value > ceiling:
            raise CheckpointError(f"{where}: {key} is {value:,}, more than the {ceiling:,} attnlab reads")


def check_special_ids(config: Mapping, where, vocab_size: int | None = None,
                    keys: Iterable[str] = ("bos_token_id", "eos_token_id"), *,
                    typed: Iterable[str] = ("pad_token_id",)) -> None:
    """Each of ``keys`` is null, a token id (an integer >= 0, below ``vocab_size`` when it is
    given) or, for ``eos_token_id``, a list of them; each of ``typed`` is null or an integer.

    A ``config.json`` is checked without ``vocab_size``: its tokenizer is another file, and
    an id past the embedding only never comes out of the model.

    Raises:
        CheckpointError: naming ``where``, the key and the value.
    """
    top = vocab_size if vocab_size is not None else float("inf")
    for key in keys:
        value = config.get(key)
        values = value if isinstance(value, list | tuple) and key == "eos_token_id" else [value]
        for v in values:
            if v is None and len(values) == 1:
                continue
            if not _is_int(v) or not 0 <= v < top:
                where_ = "" if vocab_size is None else f" in [0, {vocab_size})"
                raise CheckpointError(f"{where}: {key} must be a token id{where_} (an integer >= 0), "
                                      f"got {value!r:.60}")
    for key in typed:
        value = config.get(key)
        if value is not None and not _is_int(value):
            raise CheckpointError(f"{where}: {key} must be an integer, got {value!r:.60}")


def check_decoder_config(config: Mapping, where) -> None:
    """A Llama-family (Llama, Mistral, Qwen2/3, Gemma, OLMo-2, Phi-3) config in ``config.json``'s names
    (a GGUF file's metadata is put in these names first): sizes, head arithmetic, rotary
    values, the norm's epsilon, special token ids.

    Raises:
        CheckpointError: naming ``where``, the key and the value.
    """
    check_sizes(config, where, required=_DECODER_SIZES,
                optional=("num_key_value_heads", "head_dim", "max_position_embeddings"))
    H = config["num_attention_heads"]
    K = config.get("num_key_value_heads") or H
    D = config["hidden_size"]
    if H % K:
        raise CheckpointError(f"{where}: num_attention_heads={H} is not a multiple of num_key_value_heads={K}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if D % H:
            raise CheckpointError(f"{where}: hidden_size={D} is not a multiple of num_attention_heads={H} "
                                  "(and there is no head_dim)")
        head_dim = D // H
    if H * head_dim > MAX_WIDTH:
        raise CheckpointError(f"{where}: num_attention_heads x head_dim is {H * head_dim:,}, more than the "
                              f"{MAX_WIDTH:,} attnlab reads")
    window = config.get("sliding_window")
    if window is not None:
        check_sizes(config, where, optional=("sliding_window",))
    eps = config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps >= 0):
        raise CheckpointError(f"{where}: rms_norm_eps must be a finite number >= 0, got {eps!r:.60}")
    from attnlab.core.rotary import RopeConfig

    try:
        RopeConfig.from_hf(config, head_dim=head_dim)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    check_special_ids(config, where)


# The tensors of a Llama-family decoder in transformers' names, by the name after
# "model.layers.{i}." for a block's: their shapes in the config's sizes (V vocabulary, D
# width, F feed-forward width, H query heads, K key/value heads, E head dim).
_TOP = {"model.embed_tokens.weight": "V D", "model.norm.weight": "D", "lm_head.weight": "V D"}
_BLOCK = {
    "input_layernorm.weight": "D", "post_attention_layernorm.weight": "D",
    "pre_feedforward_layernorm.weight": "D", "post_feedforward_layernorm.weight": "D",
    "self_attn.q_proj.weight": "HE D", "self_attn.k_proj.weight": "KE D", "self_attn.v_proj.weight": "KE D",
    "self_attn.o_proj.weight": "D HE",
    "self_attn.q_proj.bias": "HE", "self_attn.k_proj.bias": "KE", "self_attn.v_proj.bias": "KE",
    "self_attn.o_proj.bias": "D", "self_attn.q_norm.weight": "E", "self_attn.k_norm.weight": "E",
    "mlp.gate_proj.weight": "F D", "mlp.up_proj.weight": "F D", "mlp.down_proj.weight": "D F",
    "mlp.gate_proj.bias": "F", "mlp.up_proj.bias": "F", "mlp.down_proj.bias": "D",
}
# A family's own shapes for a name (a dimension may be a sum: Phi-3's fused projections).
_FAMILY_BLOCK = {
    "olmo2": {"self_attn.q_norm.weight": "HE", "self_attn.k_norm.weight": "KE"},  # over the whole projection
    "phi3": {"self_attn.qkv_proj.weight": "HE+KE+KE D", "mlp.gate_up_proj.weight": "F+F D"},
}
# What every block of a family holds (a family's name map may ask for more).
_NEEDED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
           "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
           "mlp.up_proj.weight", "mlp.down_proj.weight")
_FAMILY_NEEDS = {
    "qwen2": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "qwen3": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    "gemma2": ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    "gemma3_text": ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                    "self_attn.q_norm.weight", "self_attn.k_norm.weight"),
}
# Families whose blocks hold another set than _NEEDED.
_FAMILY_ONLY = {
    "olmo2": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight"),
    "phi3": ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"),
}
_SIZE_KEYS = {"V": "vocab_size", "D": "hidden_size", "F": "intermediate_size", "H": "num_attention_heads",
              "K": "num_key_value_heads", "E": "head_dim"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _sizes(config: Mapping) -> dict[str, int]:
    H = config["num_attention_heads"]
    return {"V": config["vocab_size"], "D": config["hidden_size"], "F": config["intermediate_size"], "H": H,
            "K": config.get("num_key_value_heads") or H, "E": config.get("head_dim") or config["hidden_size"] // H}


def decoder_tensor_shape(name: str, config: Mapping) -> tuple[int, ...] | None:
    """The shape a Llama-family tensor (transformers' name) has under ``config``, or None for a
    name the family does not have.

    >>> c = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    ...      "num_attention_heads": 4, "num_key_value_heads": 2}
    >>> decoder_tensor_shape("model.layers.0.self_attn.k_proj.weight", c), decoder_tensor_shape("lm_head.weight", c)
    ((4, 8), (10, 8))
    """
    rule = _rule(name, config)
    if rule is None:
        return None
    sizes = _sizes(config)
    return tuple(sum(math.prod(sizes[c] for c in term) for term in dim.split("+")) for dim in rule.split())


def _rule(name: str, config: Mapping) -> str | None:
    m = _LAYER.fullmatch(name)
    if not m:
        return _TOP.get(name)
    own = _FAMILY_BLOCK.get(config.get("model_type"), {})
    return own.get(m.group(2), _BLOCK.get(m.group(2)))


def _size_names(name: str, config: Mapping) -> str:
    """The config's keys that make a tensor's shape: ``"(num_attention_heads x head_dim, hidden_size)"``."""
    dims = [" + ".join(" x ".join(_SIZE_KEYS[c] for c in term) for term in dim.split("+"))
            for dim in _rule(name, config).split()]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def check_decoder_tensors(config: Mapping, shapes: Mapping[str, tuple[int, ...]], where, *,
                          needed: Iterable[str] | None = None, file_name: Callable[[str], str] | None = None) -> None:
    """The tensors a file holds (``shapes``: transformers' name -> shape, from its header)
    against a checked Llama-family ``config`` (:func:`check_decoder_config`): as many blocks
    as ``num_hidden_layers``; every ``needed`` tensor there (default: what every block of
    the ``model_type`` holds, the embedding, the final norm and, unless tied, ``lm_head``);
    every tensor of the family of the shape the config gives it.

    Args:
        file_name: transformers' name -> the file's own name, for the messages (GGUF's).

    Raises:
        CheckpointError: naming ``where``, the tensor, its shape and the config's keys.
    """
    name_of = file_name or (lambda name: name)
    n = config["num_hidden_layers"]
    found = {int(m.group(1)) for name in shapes if (m := _LAYER.fullmatch(name))}
    if found and (max(found) + 1 != n or len(found) != n):
        holds = f"{max(found) + 1} blocks" if len(found) == max(found) + 1 else f"blocks {sorted(found)[:8]}"
        raise CheckpointError(f"{where}: num_hidden_layers is {n:,}, but the file holds {holds}")
    if needed is None:
        kind = config.get("model_type")
        block = _FAMILY_ONLY.get(kind) or (*_NEEDED, *_FAMILY_NEEDS.get(kind, ()))
        needed = ["model.embed_tokens.weight", "model.norm.weight",
                  *([] if config.get("tie_word_embeddings") else ["lm_head.weight"]),
                  *(f"model.layers.{i}.{b}" for i in range(n) for b in block)]
    missing = sorted(t for t in needed if t not in shapes)
    if missing:
        shown = ", ".join(name_of(t) for t in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {shown}{more}")
    for name, shape in shapes.items():
        want = decoder_tensor_shape(name, config)
        got = tuple(shape)
        if len(got) == 2 and got[0] == 1 and len(want or ()) == 1:
            got = got[1:]  # a norm's weight stored as one row
        if want is not None and got != want:
            raise CheckpointError(f"{where}: tensor {name_of(name)} has shape {tuple(shape)}, but the "
                                  f"config's {_size_names(name, config)} is {want}")


def check_weights(w, name: str, where, *, limit: float = MAX_WEIGHT) -> None:
    """A float tensor just read holds finite values within ``limit`` of zero (default
    :data:`MAX_WEIGHT`; ``math.inf``: finite values only).

    >>> import numpy as np
    >>> check_weights(np.array([1.0, 1e22], np.float32), "w", "f.gguf")
    Traceback (most recent call last):
    ...
    attnlab.io.files.CheckpointError: f.gguf: tensor w holds a value of magnitude 1e+22; weights lie within ±65504
    """
    import numpy as np

    if w.size == 0 or w.dtype.kind != "f":
        return
    top = max(float(np.max(w)), -float(np.min(w)))  # no temporary array; NaN when any is NaN
    if not math.isfinite(top):
        raise CheckpointError(f"{where}: tensor {name} holds NaN or inf")
    if top > limit:
        raise CheckpointError(f"{where}: tensor {name} holds a value of magnitude {top:.3g}; weights lie within "
                              f"±{limit:g}")
