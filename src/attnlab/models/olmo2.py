"""The OLMo-2 family built from attnlab's blocks, from a Hugging Face folder.

The same shared layers as :mod:`attnlab.models.llama`, in OLMo-2's arrangement, as
``transformers``' ``Olmo2ForCausalLM`` computes it::

    ids (B, T) -> token embedding
               -> n x TransformerBlock with its norms after each sublayer (no pre-norm):
                    Attention(grouped-query heads, QK-norm over the whole q and k
                              projections, rotary positions) -> RMSNorm -> + residual
                    GatedFeedForward (SwiGLU)                  -> RMSNorm -> + residual
               -> RMSNorm -> output layer (tied to the embedding or not) -> logits (B, T, V)

Where Llama normalises a sublayer's input, OLMo-2 normalises its output before the residual
adds it (the block's ``post_attn_norm``/``post_mlp_norm`` slots; its pre-norm slots hold
:class:`NoNorm`), and its QK-norm is an RMSNorm over all ``H D`` query features (``H_kv D``
key features) at once, not per head (the attention's ``qk_norm_per_head=False``).

All the rest (loading, generation, the text methods, ``inspect``, ``trace``, the hook
points, the backward pass) is :class:`~attnlab.models.llama.Llama`'s. Shapes: ``B``
sequences, ``T`` tokens, ``D`` model width, ``H`` query heads, ``H_kv`` key/value heads,
``V`` vocabulary size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from attnlab.models.llama import Llama, LlamaConfig, check_family, llama_name_map
from attnlab.models.registry import FAMILIES as _REGISTRY
from attnlab.nn.module import Module

__all__ = ["FAMILIES", "NoNorm", "Olmo2", "Olmo2Config", "olmo2_name_map"]

#: ``model_type`` -> ``transformers``' class: the registry's families arranged by this module.
FAMILIES = {f.model_types[0]: f.architectures[0] for f in _REGISTRY.values() if f.module == __name__}


@dataclass(frozen=True)
class Olmo2Config(LlamaConfig):
    """The architecture of an OLMo-2 model: :class:`~attnlab.models.llama.LlamaConfig`'s
    fields, with ``qk_norm`` an RMSNorm over the whole query and key projections (on by
    default, as in every OLMo-2) and ``qkv_bias``/``out_bias`` both ``attention_bias``.

    >>> c = Olmo2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                 num_attention_heads=2)
    >>> c.model_type, c.qk_norm
    ('olmo2', True)
    """

    model_type: str = "olmo2"
    qk_norm: bool = True

    def _families(self) -> Mapping[str, str]:
        return FAMILIES

    @classmethod
    def from_dict(cls, data: Mapping, *, where: object = "config") -> Olmo2Config:
        """A config from an ``Olmo2ForCausalLM`` ``config.json`` dict: Llama's fields (read as
        :meth:`LlamaConfig.from_dict <attnlab.models.llama.LlamaConfig.from_dict>` reads a
        Llama's: sizes, rotary parameters and scaling, ``attention_bias`` on q, k, v and o).

        Raises:
            CheckpointError: another ``model_type``/``architectures``, an unsupported
                ``rope_scaling`` type, a missing or bad field.
        """
        kind = check_family(data, where, FAMILIES)
        llama = LlamaConfig.from_dict({**data, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                                      where=where)
        return cls(**{**llama.to_dict(), "model_type": kind, "qk_norm": True})


def olmo2_name_map(config: Olmo2Config) -> dict[str, tuple[str, ...]]:
    """attnlab parameter name -> the ``transformers`` tensor(s) it is made of: Llama's
    (:func:`~attnlab.models.llama.llama_name_map`) with the norms after the sublayers
    (``ln_1_post``, ``ln_2_post``) in place of the norms before them.

    >>> m = olmo2_name_map(Olmo2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                                num_attention_heads=2))
    >>> m["blocks.0.ln_1_post.weight"], "blocks.0.ln_1.weight" in m
    (('model.layers.0.post_attention_layernorm.weight',), False)
    """
    m = llama_name_map(config)
    for i in range(config.num_hidden_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        del m[b + "ln_1.weight"], m[b + "ln_2.weight"]
        m[b + "ln_1_post.weight"] = (h + "post_attention_layernorm.weight",)
        m[b + "ln_2_post.weight"] = (h + "post_feedforward_layernorm.weight",)
    return m


class NoNorm(Module):
    """An empty norm slot: the identity, forward and backward (a block whose sublayers read
    the residual as it is, such as OLMo-2's, whose norms come after its sublayers).

    >>> NoNorm()(np.ones(2, np.float32))
    array([1., 1.], dtype=float32)
    """

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return grad_output


class Olmo2(Llama):
    """An OLMo-2 causal language model (``transformers``' ``Olmo2ForCausalLM``; eval mode),
    with :class:`~attnlab.models.llama.Llama`'s interface: :meth:`from_pretrained` (a
    Hugging Face folder), ``model(input_ids, attention_mask)`` -> logits, ``generate``,
    ``generate_text``, ``inspect``, ``trace``, the hook points, and after :meth:`train`
    :meth:`backward`.

    Hook points: Llama's without ``ln1``/``ln2`` (there is no pre-norm), with each block's
    ``ln1_post`` and ``ln2_post``; ``blocks.{i}.hook_attn_out`` and ``hook_mlp_out`` are the
    normed outputs the residual adds; ``attn.hook_q``/``hook_k`` the projections before
    the QK-norm.

    Parameter names: Llama's without ``blocks.{i}.ln_1.weight``/``ln_2.weight``, with
    ``blocks.{i}.ln_1_post.weight`` (``post_attention_layernorm``), ``ln_2_post.weight``
    (``post_feedforward_layernorm``) and ``attn.q_norm.weight`` ``(H D,)``,
    ``attn.k_norm.weight`` ``(H_kv D,)``.

    Args: as :class:`~attnlab.models.llama.Llama`'s, with an :class:`Olmo2Config`.

    >>> cfg = Olmo2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    >>> model = Olmo2(cfg, rng=np.random.default_rng(0))
    >>> model(np.array([[1, 2, 3]])).shape, model.layers[0].attn.q_norm.weight.shape
    ((1, 3, 50), (16,))
    """

    config_class = Olmo2Config
    name_map = staticmethod(olmo2_name_map)

    def _attention_options(self, i: int) -> dict:
        """Llama's rotary slot, and the QK-norm over the whole q and k projections."""
        return {**super()._attention_options(i), "qk_norm_per_head": False}

    def _block_norms(self, dtype) -> dict:
        """No norm before the sublayers; one after each, before the residual adds it."""
        D = self.config.hidden_size
        return {"ln_1": NoNorm(), "ln_2": NoNorm(), "post_attn_norm": self._norm(D, dtype),
                "post_mlp_norm": self._norm(D, dtype)}
