"""Move layers and models between attnlab and PyTorch (torch is imported here, only when called).

A model exported with :func:`to_torch` is an ordinary ``torch.nn.Module``: it trains with
torch's optimizers and, across processes or machines, with
``torch.nn.parallel.DistributedDataParallel``; :func:`from_torch` brings the trained weights
back. What each attnlab class becomes:

- ``Linear``, ``MultiheadAttention``: ``torch.nn.Linear``, ``torch.nn.MultiheadAttention``;
- ``SelfAttention``, ``TinyTransformer``: torch modules with attnlab's ``state_dict`` names;
- ``BertEncoder``: a ``transformers`` ``BertModel`` (Hugging Face names, through
  :func:`attnlab.io.bert_name_map`; needs the ``transformers`` package);
- the decoder families of the model registry (``Llama``: Llama, Mistral, Qwen2, Qwen3;
  ``Gemma``: Gemma 2 and 3): ``transformers``' class of the family (``LlamaForCausalLM``,
  ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
  ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``), by one conversion: the config written
  back as ``transformers``' ``config.json`` (:func:`hf_config`), the weights through the
  model's name map (:attr:`~attnlab.models.llama.Llama.name_map`); :func:`from_torch`
  recognises them by the registry's ``architectures`` and reads them back through the
  family's config and model classes.

To run a layer's own forward on torch tensors instead, convert its weights with
:meth:`attnlab.nn.Module.to` (``layer.to(torch)``).

>>> import numpy as np, attnlab
>>> layer = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
>>> torch_mha = to_torch(layer)                 # a torch.nn.MultiheadAttention
>>> back = from_torch(torch_mha)
>>> all(np.array_equal(a, b) for a, b in zip(layer.state_dict().values(), back.state_dict().values()))
True
"""

from __future__ import annotations

import numpy as np

from attnlab.io.names import NameMap, bert_name_map, gpt2_name_map, gpt2_transposed
from attnlab.models.bert import BertConfig, BertEncoder
from attnlab.models.gpt2 import GPT2, GPT2Config, unsupported_setting
from attnlab.models.llama import Llama
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.models.tiny_torch import torch_tiny_transformer
from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module

_TORCH_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}
# What to_torch and from_torch support, for their errors (a new model adds its names here).
_TO_TORCH = "MultiheadAttention, SelfAttention, Linear, Llama, Gemma, TinyTransformer, BertEncoder and GPT2"
_FROM_TORCH = (
    "nn.MultiheadAttention, nn.Linear, transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
    "Qwen3ForCausalLM, Gemma2ForCausalLM or Gemma3ForCausalLM, to_torch(SelfAttention), to_torch(TinyTransformer), "
    "transformers' GPT2LMHeadModel or GPT2Model and "
    "transformers' BertModel"
)


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.interop needs PyTorch: pip install torch==2.13.0") from exc
    return torch


def _torch_self_attention_class():
    """A torch module equal to :class:`attnlab.SelfAttention` (the trainable single head)."""
    torch = _torch()

    class TorchSelfAttention(torch.nn.Module):
        def __init__(self, d_in, d_out, qkv_bias=False):
            super().__init__()
            self.d_in, self.d_out = d_in, d_out
            self.W_q = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_k = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_v = torch.nn.Linear(d_in, d_out, bias=qkv_bias)

        def forward(self, x):
            q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
            weights = torch.softmax(q @ k.transpose(-2, -1) / self.d_out**0.5, dim=-1)
            return weights @ v, weights

    return TorchSelfAttention


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("BERT models move to torch as transformers' BertModel: pip install transformers") from exc
    return transformers


def _for_loading(build):
    """``build()`` (a ``transformers`` model) without its random initialisation, where
    ``transformers`` can skip it (``no_init_weights``): the caller loads every parameter
    from a state dict and checks that none is missing. SmolLM2-135M: to_torch 1.2 s -> 0.13 s. The
    buffers a model computes in its constructor (rotary frequencies, position ids) are
    made as usual; tied weights are tied here, as the initialisation would."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4
        except ImportError:  # pragma: no cover - depends on the environment
            return build()
    with no_init_weights():
        module = build()
    module.tie_weights()  # skipped with the initialisation
    return module


def _split_to_checkpoint(state: dict[str, np.ndarray], name_map: NameMap) -> dict[str, np.ndarray]:
    """attnlab-named arrays -> checkpoint-named ones: the inverse of the name map's loading
    (a fused tensor is split back, along axis 0, into its equal sources)."""
    out = {}
    for ours, sources in name_map.items():
        for src, part in zip(sources, np.split(state[ours], len(sources)), strict=True):
            out[src] = part
    return out


# ---- BERT: attnlab's BertEncoder <-> transformers' BertModel ------------------------------
def _bert_to_torch(model: BertEncoder):
    """A ``transformers.BertModel`` (no pooler, no dropout: the same function as ``model``)."""
    transformers, torch = _transformers(), _torch()
    c = model.config
    hf_config = transformers.BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
        max_position_embeddings=c.max_position_embeddings, type_vocab_size=c.type_vocab_size,
        layer_norm_eps=c.layer_norm_eps, hidden_act=c.hidden_act, pad_token_id=c.pad_token_id,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    state = _split_to_checkpoint(model.state_dict(), bert_name_map(c.num_hidden_layers))
    dtype = getattr(torch, _TORCH_DTYPES[next(iter(state.values())).dtype])
    module = _for_loading(lambda: transformers.BertModel(hf_config, add_pooling_layer=False)).to(dtype)
    module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    return module


def _bert_from_torch(module, rng) -> BertEncoder:
    """A :class:`~attnlab.models.BertEncoder` with a ``BertModel``'s architecture and weights
    (the pooler, which attnlab's encoder has not, is left out)."""
    hf = module.config
    kind = getattr(hf, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"BertEncoder has absolute position embeddings; this BertModel's are {kind!r}")
    config = BertConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
        max_position_embeddings=hf.max_position_embeddings, type_vocab_size=hf.type_vocab_size,
        layer_norm_eps=hf.layer_norm_eps, hidden_act=hf.hidden_act, pad_token_id=hf.pad_token_id or 0,
    )
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    dtype = state["embeddings.word_embeddings.weight"].dtype
    return BertEncoder(config, weights=state, dtype=dtype, rng=rng)


def _is_bert_model(module) -> bool:
    """A ``transformers`` ``BertModel``, as the model registry names the family's classes."""
    family = _registry_family(module)
    return family is not None and family.name == "bert" and type(module).__name__ == "BertModel"


# ---- GPT-2: attnlab's GPT2 <-> transformers' GPT2LMHeadModel -----------------------------
def _gpt2_to_torch(model: GPT2):
    """A ``transformers.GPT2LMHeadModel`` (dropout 0: the same function as ``model``)."""
    transformers, torch = _transformers(), _torch()
    c = model.config
    hf_config = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, n_inner=c.n_inner, activation_function=c.activation_function,
        layer_norm_epsilon=c.layer_norm_epsilon, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    transposed = gpt2_transposed(c.n_layer)
    ours = model.state_dict()
    state = {}
    for name, (src,) in gpt2_name_map(c.n_layer).items():  # Conv1D weights are stored (in, out)
        state["transformer." + src] = ours[name].T if name in transposed else ours[name]
    state["lm_head.weight"] = ours["tok_emb.weight"]  # tied to the token embedding
    dtype = getattr(torch, _TORCH_DTYPES[ours["tok_emb.weight"].dtype])
    module = _for_loading(lambda: transformers.GPT2LMHeadModel(hf_config)).to(dtype)
    missing, unexpected = module.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    if unexpected or any(not k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing):
        raise ValueError(f"GPT2LMHeadModel names do not match: missing {missing}, unexpected {unexpected}")
    return module


def _gpt2_from_torch(module, rng) -> GPT2:
    """A :class:`~attnlab.models.GPT2` with a ``GPT2LMHeadModel``'s (or ``GPT2Model``'s)
    architecture and weights; settings it does not compute are refused, as
    :meth:`GPT2.from_pretrained` refuses them."""
    hf = module.config
    problem = unsupported_setting(hf)
    if problem is not None:
        raise ValueError(f"{type(module).__name__}: {problem}")
    config = GPT2Config(
        vocab_size=hf.vocab_size, n_positions=hf.n_positions, n_embd=hf.n_embd, n_layer=hf.n_layer,
        n_head=hf.n_head, n_inner=hf.n_inner, activation_function=hf.activation_function,
        layer_norm_epsilon=hf.layer_norm_epsilon, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id,
    )
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()
             if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
    dtype = next(iter(state.values())).dtype
    return GPT2(config, weights=state, rng=rng, dtype=dtype)


def _is_gpt2_model(module) -> bool:
    """A ``transformers`` ``GPT2LMHeadModel`` or ``GPT2Model`` (the registry's ``gpt2`` classes)."""
    family = _registry_family(module)
    return family is not None and family.name == "gpt2"


def _mha_config(mha) -> dict:
    """Constructor arguments of a MultiheadAttention, attnlab's or torch's (same attributes)."""
    return dict(
        embed_dim=mha.embed_dim,
        num_heads=mha.num_heads,
        dropout=mha.dropout,
        bias=mha.in_proj_bias is not None,
        add_bias_kv=mha.bias_k is not None,
        add_zero_attn=mha.add_zero_attn,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=mha.batch_first,
    )


def to_torch(layer: Module):
    """A ``torch.nn`` module with ``layer``'s configuration and weights (same dtype).

    Supports :class:`~attnlab.MultiheadAttention` (-> ``torch.nn.MultiheadAttention``),
    :class:`~attnlab.Linear` (-> ``torch.nn.Linear``), :class:`~attnlab.SelfAttention`
    (-> an equivalent torch module), :class:`~attnlab.models.TinyTransformer` (-> a torch
    module with the same ``state_dict`` names that maps ``ids (B, T)`` to the same logits)
    :class:`~attnlab.models.GPT2` (-> a ``transformers`` ``GPT2LMHeadModel`` with the same
    logits, dropout 0), :class:`~attnlab.models.llama.Llama` and
    :class:`~attnlab.models.gemma.Gemma` (-> ``transformers``' ``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM``, as its ``model_type``, with the same
    logits) and
    :class:`~attnlab.models.BertEncoder` (-> a ``transformers`` ``BertModel`` built from
    a matching ``BertConfig``, without pooler and with dropout 0 as attnlab's encoder, whose
    ``last_hidden_state`` and ``hidden_states`` equal the encoder's; the tokenizer stays
    with attnlab). Training/eval mode is copied. The weights may be in any library
    (:meth:`~attnlab.nn.Module.to`).

    >>> import numpy as np, torch
    >>> from attnlab.models import TinyTransformer, TinyTransformerConfig
    >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32, dtype="float64")
    >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> bool(np.allclose(to_torch(model)(torch.from_numpy(ids)).detach().numpy(), model(ids)))
    True
    """
    torch = _torch()
    if isinstance(layer, Llama):  # a registry decoder family (Llama, Mistral, Qwen2/3, Gemma 2/3)
        module = _decoder_to_torch(layer)
        module.train(layer.training)
        return module
    if not isinstance(layer, MultiheadAttention | Linear | SelfAttention | TinyTransformer | BertEncoder | GPT2):
        raise TypeError(f"to_torch supports {_TO_TORCH}, got {type(layer).__name__}")
    state = layer.state_dict()  # NumPy copies, wherever the weights are
    dtype = getattr(torch, _TORCH_DTYPES[next(iter(state.values())).dtype])
    if isinstance(layer, BertEncoder | GPT2):
        module = (_bert_to_torch if isinstance(layer, BertEncoder) else _gpt2_to_torch)(layer)
        module.train(layer.training)
        return module
    if isinstance(layer, MultiheadAttention):
        module = torch.nn.MultiheadAttention(**_mha_config(layer), dtype=dtype)
    elif isinstance(layer, Linear):
        module = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
    elif isinstance(layer, SelfAttention):
        cls = _torch_self_attention_class()
        module = cls(layer.d_in, layer.d_out, qkv_bias=layer.W_q.bias is not None).to(dtype)
    else:
        module = torch_tiny_transformer(layer.config)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    module.train(layer.training)
    return module


def from_torch(module, *, rng: np.random.Generator | None = None) -> Module:
    """An attnlab layer with ``module``'s configuration and weights (same dtype).

    Accepts ``torch.nn.MultiheadAttention``, ``torch.nn.Linear``, the modules returned by
    :func:`to_torch` for a ``SelfAttention`` or a ``TinyTransformer``, a ``transformers``
    ``GPT2LMHeadModel`` or ``GPT2Model`` (-> a :class:`~attnlab.models.GPT2`), ``transformers``'
    ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``
    (-> a :class:`~attnlab.models.llama.Llama` without tokenizer), ``Gemma2ForCausalLM`` and
    ``Gemma3ForCausalLM`` (-> a :class:`~attnlab.models.gemma.Gemma`) and a ``transformers``
    ``BertModel`` (-> a :class:`~attnlab.models.BertEncoder` without tokenizer; its pooler is
    left out; a model with a BERT inside, such as ``BertForMaskedLM``, gives its encoder),
    also after training in torch, and any of these wrapped in ``DistributedDataParallel``
    or ``DataParallel``. ``rng`` drives the new layer's dropout.

    Raises:
        ValueError: a GPT-2 with settings attnlab's GPT-2 does not compute (an output layer
            not tied to the token embedding, unscaled or layer-scaled attention,
            cross-attention), refused as :meth:`~attnlab.models.GPT2.from_pretrained`
            refuses such a folder.
        TypeError: a module of another kind.
    """
    torch = _torch()
    if isinstance(module, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        module = module.module  # the wrapped model, with its own state_dict names
    inner = getattr(module, "bert", None)  # BertForMaskedLM, BertForSequenceClassification, ...
    if _is_bert_model(module) or (inner is not None and _is_bert_model(inner)):
        layer = _bert_from_torch(module if inner is None else inner, rng)
        layer.train(module.training)
        return layer
    if _is_gpt2_model(module):
        layer = _gpt2_from_torch(module, rng)
        layer.train(module.training)
        return layer
    family = _registry_family(module)
    if family is not None and family.decoder and issubclass(family.model_class(), Llama):
        layer = _decoder_from_torch(module, family)
        layer.train(module.training)
        return layer
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    if isinstance(module, torch.nn.MultiheadAttention):
        layer = MultiheadAttention(**_mha_config(module), rng=rng, dtype=dtype)
    elif isinstance(module, torch.nn.Linear):
        layer = Linear(module.in_features, module.out_features, bias=module.bias is not None, rng=rng, dtype=dtype)
    elif type(module).__name__ == "TorchSelfAttention":
        layer = SelfAttention(module.d_in, module.d_out, qkv_bias=module.W_q.bias is not None, rng=rng, dtype=dtype)
    elif isinstance(getattr(module, "attnlab_config", None), TinyTransformerConfig):
        layer = TinyTransformer(module.attnlab_config, rng=rng)
    else:
        raise TypeError(f"from_torch supports {_FROM_TORCH}, got {type(module).__name__}")
    layer.load_state_dict(state)
    layer.train(module.training)
    return layer


# ---- the Llama family: attnlab's Llama <-> transformers' LlamaForCausalLM and relatives ----------
def _registry_family(module):
    """The family of the model registry whose ``architectures`` name ``module``'s class (a
    ``transformers`` model), or None."""
    if not type(module).__module__.startswith("transformers."):
        return None
    from attnlab.models.registry import FAMILIES

    name = type(module).__name__
    return next((f for f in FAMILIES.values() if name in f.architectures), None)


def _split_sizes(state: dict[str, np.ndarray], name_map: NameMap, sizes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """attnlab-named arrays -> checkpoint-named ones, a fused tensor split along axis 0 into
    parts of the given sizes (grouped-query heads: ``H * D_h`` query rows, then ``H_kv * D_h``
    key rows and as many value rows)."""
    out = {}
    for ours, sources in name_map.items():
        if len(sources) == 1:
            out[sources[0]] = state[ours]
            continue
        parts = np.split(state[ours], np.cumsum(sizes[ours.rsplit(".", 1)[-1]])[:-1])
        for src, part in zip(sources, parts, strict=True):
            out[src] = part
    return out


def llama_hf_config(config) -> dict:
    """The ``transformers`` ``config.json`` contents of a
    :class:`~attnlab.models.llama.LlamaConfig` (the inverse of ``LlamaConfig.from_dict``).

    Raises:
        ValueError: a combination the ``transformers`` class of its ``model_type`` cannot
            express (the field named), e.g. a Llama with a sliding window.

    >>> from attnlab.models.llama import LlamaConfig
    >>> c = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                 num_attention_heads=2, model_type="qwen2", qkv_bias=True)
    >>> d = llama_hf_config(c)
    >>> d["architectures"], d["num_key_value_heads"], d["use_sliding_window"]
    (['Qwen2ForCausalLM'], 2, False)
    """
    from attnlab.models.llama import FAMILIES

    c = config
    kind = c.model_type
    rope = {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    d = {
        "model_type": kind, "architectures": [FAMILIES[kind]], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": rope, "hidden_act": c.hidden_act,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_dropout": 0.0,
        "bos_token_id": c.bos_token_id, "pad_token_id": c.pad_token_id,
        "eos_token_id": list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id,
    }
    if c.head_dim is not None:
        d["head_dim"] = c.head_dim
    if c.partial_rotary_factor is not None:
        rope["partial_rotary_factor"] = d["partial_rotary_factor"] = c.partial_rotary_factor

    def refuse(what: str) -> ValueError:
        return ValueError(f"{FAMILIES[kind]} has no {what}; this {kind} config has it")

    if kind == "qwen2":
        if (c.qkv_bias, c.out_bias) != (True, False):
            raise refuse(f"qkv_bias={c.qkv_bias}, out_bias={c.out_bias} (it has q/k/v biases only)")
    elif kind == "mistral":
        if c.qkv_bias or c.out_bias:
            raise refuse("attention biases")
    else:  # llama, qwen3: attention_bias on q, k, v and the output projection alike
        if c.qkv_bias != c.out_bias:
            raise refuse(f"qkv_bias={c.qkv_bias} with out_bias={c.out_bias}")
        d["attention_bias"] = c.qkv_bias
    if c.mlp_bias:
        if kind != "llama":
            raise refuse("mlp_bias")
        d["mlp_bias"] = True
    if c.qk_norm != (kind == "qwen3"):
        raise refuse(f"qk_norm={c.qk_norm}")
    windows = c.sliding_windows or (None,) * c.num_hidden_layers
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"sliding_windows {c.sliding_windows}: transformers' {FAMILIES[kind]} has one window size")
    window = next(iter(sizes), None)
    if kind == "llama" and window is not None:
        raise refuse("sliding window")
    if kind == "mistral":
        if window is not None and None in windows:
            raise refuse(f"sliding window on some layers only ({c.sliding_windows})")
        d["sliding_window"] = window
    elif kind in ("qwen2", "qwen3"):
        d["use_sliding_window"] = window is not None
        d["sliding_window"] = window
        if window is not None:
            d["max_window_layers"] = next(i for i, w in enumerate(windows) if w is not None)
            d["layer_types"] = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    return d


def gemma_hf_config(config) -> dict:
    """The ``transformers`` ``config.json`` contents of a
    :class:`~attnlab.models.gemma.GemmaConfig` (the inverse of ``GemmaConfig.from_dict``):
    Gemma 2's or Gemma 3's (per-layer-type rotary parameters, QK-norm).

    Raises:
        ValueError: a combination the ``transformers`` class cannot express (named), e.g.
            Gemma 3 with soft-capped attention scores or two window sizes.

    >>> from attnlab.models.gemma import GemmaConfig
    >>> c = GemmaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    ...                 num_attention_heads=2, sliding_windows=(4, None), attn_logit_softcapping=50.0)
    >>> d = gemma_hf_config(c)
    >>> d["architectures"], d["layer_types"], d["sliding_window"], d["attn_logit_softcapping"]
    (['Gemma2ForCausalLM'], ['sliding_attention', 'full_attention'], 4, 50.0)
    """
    from attnlab.models.gemma import FAMILIES

    c = config
    kind = c.model_type

    def refuse(what: str) -> ValueError:
        return ValueError(f"{FAMILIES[kind]} has no {what}; this {kind} config has it")

    windows = c.sliding_windows or (None,) * c.num_hidden_layers
    sizes = {w for w in windows if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"sliding_windows {c.sliding_windows}: transformers' {FAMILIES[kind]} has one window size")
    if c.qkv_bias != c.out_bias:
        raise refuse(f"qkv_bias={c.qkv_bias} with out_bias={c.out_bias}")
    if c.mlp_bias:
        raise refuse("mlp_bias")
    if c.qk_norm != (kind == "gemma3_text"):
        raise refuse(f"qk_norm={c.qk_norm}")
    if kind == "gemma3_text" and c.attn_logit_softcapping is not None:
        raise refuse("soft-capped attention scores (attn_logit_softcapping)")
    glob = {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    own_local = c.local_rope_theta is not None or c.local_rope_scaling is not None
    if kind == "gemma2" and own_local:
        raise refuse("rotary parameters of its own for the local layers")
    d = {
        "model_type": kind, "architectures": [FAMILIES[kind]], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads, "head_dim": c.head_size,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "hidden_activation": c.hidden_act, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.qkv_bias, "attention_dropout": 0.0,
        "query_pre_attn_scalar": c.head_size if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping,
        "sliding_window": next(iter(sizes), None),
        "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows],
        "bos_token_id": c.bos_token_id, "pad_token_id": c.pad_token_id,
        "eos_token_id": list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id,
    }
    if kind == "gemma2":
        d["rope_parameters"] = glob
    else:  # the local layers' own base (and scaling), or the global layers' rotary parameters
        local = {"rope_type": "default", **dict(c.local_rope_scaling or {}),
                 "rope_theta": c.rope_theta if c.local_rope_theta is None else c.local_rope_theta} \
            if own_local else glob
        d["rope_parameters"] = {"full_attention": glob, "sliding_attention": local}
    return d


def hf_config(config) -> dict:
    """The ``transformers`` ``config.json`` contents of a registry decoder family's config:
    :func:`gemma_hf_config` for a :class:`~attnlab.models.gemma.GemmaConfig`, else
    :func:`llama_hf_config` (Llama, Mistral, Qwen2, Qwen3)."""
    from attnlab.models.gemma import GemmaConfig

    return gemma_hf_config(config) if isinstance(config, GemmaConfig) else llama_hf_config(config)


def _decoder_to_torch(model: Llama):
    """``transformers``' class of ``model``'s family (``LlamaForCausalLM``,
    ``Gemma2ForCausalLM``…) with its weights (attention dropout 0: the same function as
    ``model``): the config through :func:`hf_config`, the weights through the model's own
    name map, a fused q/k/v tensor split by the query and key/value heads' sizes."""
    transformers, torch = _transformers(), _torch()
    c = model.config
    d = hf_config(c)
    kind = d.pop("model_type")
    hf = transformers.AutoConfig.for_model(kind, **d)
    H, Hkv, Dh = c.num_attention_heads, c.kv_heads, c.head_size
    sizes = [H * Dh, Hkv * Dh, Hkv * Dh]
    ours = model.state_dict()
    state = _split_sizes(ours, model.name_map(c), {"in_proj_weight": sizes, "in_proj_bias": sizes})
    dtype = getattr(torch, _TORCH_DTYPES[ours["tok_emb.weight"].dtype])
    module = _for_loading(lambda: getattr(transformers, d["architectures"][0])(hf)).to(dtype)
    missing, unexpected = module.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    tied = ["lm_head.weight"] if c.tie_word_embeddings else []
    if unexpected or sorted(missing) != tied:
        raise ValueError(f"{type(module).__name__} names do not match: missing {missing}, unexpected {unexpected}")
    if tied and module.lm_head.weight.data_ptr() != module.model.embed_tokens.weight.data_ptr():
        raise ValueError(f"{type(module).__name__} did not tie lm_head.weight to the token embedding")
    return module


def _decoder_from_torch(module, family) -> Llama:
    """The registry family's model (a :class:`~attnlab.models.llama.Llama` or
    :class:`~attnlab.models.gemma.Gemma`) with a ``transformers`` model's architecture and
    weights, read through the family's ``config_class.from_dict``."""
    name = type(module).__name__
    data = module.config.to_dict()
    data["architectures"] = [name]
    config = family.config_class().from_dict(data, where=name)
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    dtype = state["model.embed_tokens.weight"].dtype
    return family.model_class()(config, weights=state, dtype=dtype, name=f"{name} (from torch)")
