"""transformers models as gradient oracles (imported by the gradient tests): random-weight
decoders of every family attnlab reads, and their float64 code without the float32 casts.

transformers' Llama-family code runs RMSNorm and the attention softmax in float32 even in a
float64 model; :func:`patch_eager` replaces every family's eager attention by one that keeps
each call's weights for their gradient, and in float64 the norms and the rotary embedding by
versions without the float32 casts (the rotary cos/sin taken in float64 of the float32
angles transformers computes: attnlab's float64 rotary).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import transformers

V = 61
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=40,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# id -> (transformers config class, options)
CASES = {
    "llama-gqa2-tied-llama3": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "llama-gqa3-bias-yarn": ("LlamaConfig", dict(
        num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True, hidden_size=48,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 10})),
    "llama-gqa4-dynamic": ("LlamaConfig", dict(
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0})),
    "llama-mqa-linear": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5)),
    "qwen2-bias-tied-window": ("Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=True,
        sliding_window=4, max_window_layers=1)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "gemma2-softcap-window": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0, query_pre_attn_scalar=24)),
    "gemma3-qknorm-window-untied": ("Gemma3TextConfig", dict(
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, hidden_size=48, sliding_window=4,
        sliding_window_pattern=2,
        final_logit_softcapping=5.0, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
}
MODEL_CLASS = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
               "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
               "Gemma2Config": "Gemma2ForCausalLM", "Gemma3TextConfig": "Gemma3ForCausalLM",
               "Olmo2Config": "Olmo2ForCausalLM", "Phi3Config": "Phi3ForCausalLM"}
MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def hf_decoder(case: str, seed: int, cases=CASES):
    cls_name, options = cases[case]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls_name)(**{**BASE, **options}, attn_implementation="eager")
        hf = getattr(transformers, MODEL_CLASS[cls_name])(config).eval()
        with torch.no_grad():  # weights larger than the 0.02 init, norms off their start
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.2)
                else:
                    p.mul_(4.0)
    return hf


def folder_maker(tmp_path_factory, cases=CASES):
    """A function ``case -> (transformers model, its saved folder)``, each made once."""
    made = {}

    def get(case):
        if case not in made:
            hf = hf_decoder(case, sorted(cases).index(case), cases)
            folder = tmp_path_factory.mktemp(case)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf.save_pretrained(folder)
            made[case] = hf, folder
        return made[case]

    return get


def _rms64(self, x):  # transformers' RMSNorm without the float32 cast
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x


def _gemma_rms64(self, x):
    return self._norm(x) * (1.0 + self.weight)


def _rotary64(self, x, position_ids, layer_type=None):
    """transformers' rotary embedding: float32 angles, their cos and sin in float64."""
    inv = self.inv_freq if layer_type is None else getattr(self, f"{layer_type}_inv_freq")
    scaling = self.attention_scaling if layer_type is None else getattr(self, f"{layer_type}_attention_scaling")
    freqs = position_ids[..., None].float() * inv.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1).double()
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


class _Eager:
    """transformers' eager attention (soft-cap, additive mask, grouped heads), its softmax in
    the model's dtype; each call's weights kept (``retain_grad``) for their gradient."""

    def __init__(self):
        self.patterns = []

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                 **kwargs):
        from transformers.models.llama.modeling_llama import repeat_kv

        scaling = module.head_dim ** -0.5 if scaling is None else scaling
        k = repeat_kv(key, module.num_key_value_groups)
        v = repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if softcap is not None:
            w = torch.tanh(w / softcap) * softcap
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        if w.requires_grad:
            w.retain_grad()
        self.patterns.append(w)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def patch_eager(monkeypatch, modules=MODULES):
    """Every family's eager attention (of ``modules``, transformers' module names) replaced
    by :class:`_Eager` (undone by ``monkeypatch``); its ``float64()`` also replaces the
    norms and the rotary embedding by versions without the float32 casts. Returns the
    :class:`_Eager`."""
    att = _Eager()
    for name in modules:
        mod = getattr(transformers.models, name)
        modeling = getattr(mod, f"modeling_{name}")
        monkeypatch.setattr(modeling, "eager_attention_forward", att)

    def float64():
        from transformers.modeling_rope_utils import dynamic_rope_update

        for name in modules:
            modeling = getattr(getattr(transformers.models, name), f"modeling_{name}")
            prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3"}.get(name, name.capitalize())
            norm = getattr(modeling, f"{prefix}RMSNorm")
            monkeypatch.setattr(norm, "forward", _gemma_rms64 if name.startswith("gemma") else _rms64)
            rotary = getattr(modeling, f"{prefix}RotaryEmbedding")
            monkeypatch.setattr(rotary, "forward", dynamic_rope_update(_rotary64))

    att.float64 = float64
    return att


def batch(rng, B=2, T=11, pad=3):
    """Token ids ``(B, T)``, the first row left-padded by ``pad``, and its mask."""
    ids = rng.integers(3, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return ids, mask


def positions(mask):
    pos = np.cumsum(mask, axis=-1) - 1
    pos[mask == 0] = 0
    return pos




def torch_backward(hf, ids, mask, g, handles=()):
    """transformers' logits of a left-padded batch and, in ``.grad``, the gradients of
    ``sum(logits * g)``; ``handles`` (hooks registered for this call) removed after."""
    hf.zero_grad()
    try:
        out = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 position_ids=torch.from_numpy(positions(mask)))
        (out.logits * torch.from_numpy(g)).sum().backward()
    finally:
        for h in handles:
            h.remove()
    return out.logits.detach().numpy()


def parameter_grads(ours, hf):
    """``{attnlab parameter name: (its .grad, transformers' gradient of what it is made of)}``
    through the family's name map (a source ``"name[a:b]"`` is rows ``a:b``), and the set of
    transformers tensors used."""
    from attnlab.models.llama import _source

    hp = dict(hf.named_parameters())
    names = type(ours).name_map(ours.config)
    out, seen = {}, set()
    for ours_name, p in ours.named_parameters():
        parts = []
        for source in names[ours_name]:
            tensor, rows = _source(source)
            grad = hp[tensor].grad.numpy()
            parts.append(grad if rows is None else grad[rows])
            seen.add(tensor)
        out[ours_name] = p.grad, np.concatenate(parts, axis=0)
    with_grad = {n for n, q in hp.items() if q.grad is not None}
    if seen != with_grad and seen != with_grad - {"lm_head.weight"}:  # tied: no lm_head of its own
        raise AssertionError(f"transformers tensors with a gradient that no parameter is made of: {with_grad - seen}")
    return out
