"""The Phi-3 family built from attnlab's blocks, from a Hugging Face folder.

Phi-3 (``transformers``' ``Phi3ForCausalLM``: Phi-3 mini and medium, Phi-4) is Llama's
arrangement (:mod:`attnlab.models.llama`: pre-norm blocks, RMSNorm, grouped-query
attention with rotary positions, a SiLU-gated feed-forward network) with two of its
projections fused in the checkpoint:

- ``self_attn.qkv_proj`` holds the q, k and v projections stacked, ``(H D + 2 H_kv D, D)``:
  it is attnlab's fused ``attn.in_proj_weight`` as it is (same rows, same order);
- ``mlp.gate_up_proj`` holds the gate and up projections stacked, ``(2 F, D)``: it is
  split at load into ``mlp.gate_proj.weight`` (rows ``0:F``) and ``mlp.up_proj.weight``
  (rows ``F:2F``), as attnlab keeps every gated network, so hooks, LoRA targets and the
  compiled decoding step see the same parameters as a Llama's.

A ``sliding_window`` applies to every layer (as Mistral's); a ``partial_rotary_factor``
rotates part of each head. Shapes: ``D`` model width, ``F`` feed-forward width, ``H``
query heads, ``H_kv`` key/value heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from attnlab.io.files import CheckpointError
from attnlab.models.llama import Llama, LlamaConfig, check_family, llama_name_map
from attnlab.models.registry import FAMILIES as _REGISTRY

__all__ = ["FAMILIES", "Phi3", "Phi3Config", "phi3_name_map"]

#: ``model_type`` -> ``transformers``' class: the registry's families arranged by this module.
FAMILIES = {f.model_types[0]: f.architectures[0] for f in _REGISTRY.values() if f.module == __name__}


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    """The architecture of a Phi-3 model: :class:`~attnlab.models.llama.LlamaConfig`'s fields
    (no biases; ``sliding_windows`` the same window for every layer, or None).

    >>> c = Phi3Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                num_attention_heads=2, partial_rotary_factor=0.5)
    >>> c.model_type, c.rope.rotary_dim
    ('phi3', 2)
    """

    model_type: str = "phi3"
    rms_norm_eps: float = 1e-5

    def _families(self) -> Mapping[str, str]:
        return FAMILIES

    @classmethod
    def from_dict(cls, data: Mapping, *, where: object = "config") -> Phi3Config:
        """A config from a ``Phi3ForCausalLM`` ``config.json`` dict: Llama's fields (read as
        :meth:`LlamaConfig.from_dict <attnlab.models.llama.LlamaConfig.from_dict>` reads a
        Mistral's: ``sliding_window`` on every layer), ``partial_rotary_factor`` in
        ``rope_parameters`` or at the top.

        Raises:
            CheckpointError: another ``model_type``/``architectures``; a ``rope_scaling``
                (``rope_parameters``) type other than ``default``: ``transformers`` reads
                Phi-3's ``su``, ``yarn`` and ``longrope`` as LongRoPE, which attnlab does not
                compute; a missing or bad field.
        """
        kind = check_family(data, where, FAMILIES)
        for key in ("rope_parameters", "rope_scaling"):
            params = data.get(key) or {}
            kind_of = params.get("rope_type", params.get("type", "default")) if isinstance(params, Mapping) else None
            if kind_of != "default":
                raise CheckpointError(f"{where}: {key} type {kind_of!r} is not supported for Phi-3 (transformers "
                                      "computes Phi-3's scaled rotary embedding as LongRoPE); supported: default")
        mistral = {k: v for k, v in data.items() if k != "layer_types"}  # Phi-3's window is on every layer
        llama = LlamaConfig.from_dict({**mistral, "model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                                      where=where)
        return cls(**{**llama.to_dict(), "model_type": kind})


def phi3_name_map(config: Phi3Config) -> dict[str, tuple[str, ...]]:
    """attnlab parameter name -> the ``transformers`` tensor(s) it is made of: Llama's
    (:func:`~attnlab.models.llama.llama_name_map`) with the fused ``qkv_proj`` as the
    attention's ``in_proj_weight`` and the rows of ``gate_up_proj`` as the gate's and the
    up projection's weights (``"name[a:b]"``: rows ``a:b`` of tensor ``name``).

    >>> m = phi3_name_map(Phi3Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                              num_attention_heads=2))
    >>> m["blocks.0.attn.in_proj_weight"], m["blocks.0.mlp.up_proj.weight"]
    (('model.layers.0.self_attn.qkv_proj.weight',), ('model.layers.0.mlp.gate_up_proj.weight[16:32]',))
    """
    m = llama_name_map(config)
    F = config.intermediate_size
    for i in range(config.num_hidden_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        m[b + "attn.in_proj_weight"] = (h + "self_attn.qkv_proj.weight",)
        m[b + "mlp.gate_proj.weight"] = (h + f"mlp.gate_up_proj.weight[0:{F}]",)
        m[b + "mlp.up_proj.weight"] = (h + f"mlp.gate_up_proj.weight[{F}:{2 * F}]",)
    return m


class Phi3(Llama):
    """A Phi-3 causal language model (``transformers``' ``Phi3ForCausalLM``; eval mode): a
    :class:`~attnlab.models.llama.Llama` in every way (interface, hook points, parameter
    names, backward pass) whose checkpoint fuses the q/k/v and the gate/up projections
    (see :func:`phi3_name_map`).

    Args: as :class:`~attnlab.models.llama.Llama`'s, with a :class:`Phi3Config`.

    >>> import numpy as np
    >>> cfg = Phi3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    >>> model = Phi3(cfg, rng=np.random.default_rng(0))
    >>> model(np.array([[1, 2, 3]])).shape, model.generate(np.array([[1, 2, 3]]), 4).shape
    ((1, 3, 50), (1, 7))
    """

    config_class = Phi3Config
    name_map = staticmethod(phi3_name_map)
