"""The Gemma family (Gemma 2, Gemma 3's text model) against transformers: random-weight
models of several shapes written with save_pretrained (MHA, GQA, MQA; a sliding window
shorter than the prompt on alternating layers; attention and final soft-capping on and off;
Gemma 3's QK-norm, local rotary base and scaled global rotary; tied and untied embeddings),
with eager attention as the oracle (transformers' sdpa ignores soft-capping): logits,
hidden states and maps layer by layer, greedy generation, the cache, the hook points; the
backward passes of the new slots (soft-capped attention, sandwich norms) against autograd."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.models import from_pretrained  # noqa: E402
from attnlab.models.gemma import Gemma, GemmaConfig  # noqa: E402
from attnlab.models.registry import detect  # noqa: E402
from attnlab.nn import Attention, RMSNorm, TransformerBlock  # noqa: E402
from attnlab.nn.blocks import GatedFeedForward  # noqa: E402

V = 97
BASE = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=3, max_position_embeddings=40,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# id -> (transformers config class, options)
CASES = {
    "gemma2-gqa2-window-softcap": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma2-mqa-untied": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, sliding_window=4, tie_word_embeddings=False)),
    "gemma2-mha-nocap-bias": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=12, sliding_window=6, attn_logit_softcapping=None,
        final_logit_softcapping=None, attention_bias=True)),
    "gemma3-gqa2-window-linear": ("Gemma3TextConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, sliding_window_pattern=2,
        final_logit_softcapping=2.5, attn_logit_softcapping=3.0,  # transformers' Gemma 3 ignores the latter
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    "gemma3-gqa3-window-types": ("Gemma3TextConfig", dict(
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
}


def _hf_model(case: str, seed: int):
    cls_name, options = CASES[case]
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls_name)(**{**BASE, **options}, attn_implementation="eager")
        model_cls = transformers.Gemma2ForCausalLM if cls_name == "Gemma2Config" else transformers.Gemma3ForCausalLM
        hf = model_cls(config).eval()
        with torch.no_grad():  # larger weights than the 0.02 init: the differences are visible
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.2)
                else:
                    p.mul_(8.0)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers model in eval mode, attnlab model from its saved folder, case id)."""
    hf = _hf_model(request.param, sorted(CASES).index(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(folder)
    return hf, from_pretrained(folder), request.param


def prompt(rng, B, T):
    return rng.integers(3, V, (B, T))


def test_logits_hidden_states_and_maps_match_transformers(pair):
    hf, ours, case = pair
    assert isinstance(ours, Gemma)
    rng = np.random.default_rng(1)
    T = 16
    ids = prompt(rng, 2, T)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_hidden_states=True, output_attentions=True)
    got = ours.inspect(ids)
    want = out.logits.numpy()
    assert np.abs(got.logits - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), case
    assert np.abs(want).max() > 1.0  # the logits are not all near zero
    cap = ours.config.final_logit_softcapping
    if cap is not None:
        assert np.abs(got.logits).max() < cap
        if cap < 5:  # these small caps are reached: without them the logits would differ
            raw = ours.ln_f(got.hidden_states[-1]) @ ours.W_U
            assert np.abs(raw).max() > cap
    n = ours.config.num_hidden_layers
    hs = [h.numpy() for h in out.hidden_states]
    for k in range(n):  # the scaled embeddings and the blocks before the last; the last after the norm
        assert np.abs(got.hidden_states[k] - hs[k]).max() <= 1e-4 * max(1.0, np.abs(hs[k]).max()), (case, k)
    assert np.abs(ours.ln_f(got.hidden_states[n]) - hs[n]).max() <= 1e-4 * max(1.0, np.abs(hs[n]).max())
    for k, a in enumerate(out.attentions):
        assert np.abs(got.attentions[k] - a.numpy()).max() <= 1e-4, (case, k)
    # a local layer's window is shorter than the prompt: its earliest keys are masked
    local = [i for i in range(n) if ours.config.window(i) is not None]
    glob = [i for i in range(n) if ours.config.window(i) is None]
    assert local and glob
    w = ours.config.window(local[0])
    assert w < T and (got.attentions[local[0]][:, :, -1, : T - w] == 0).all()
    assert (got.attentions[glob[0]][:, :, -1, : T - w] > 0).all()


def test_cached_logits_equal_full_recompute(pair):
    hf, ours, case = pair
    rng = np.random.default_rng(2)
    T = 20
    ids = prompt(rng, 2, T)
    full = ours(ids)
    cache = ours.new_cache()
    parts = [ours(ids[:, :9], cache=cache)]
    for t in range(9, T):  # past every sliding window
        parts.append(ours(ids[:, t : t + 1], cache=cache))
    stepped = np.concatenate(parts, axis=1)
    assert np.abs(stepped - full).max() <= 1e-5 * max(1.0, np.abs(full).max()), case


def test_greedy_generation_equals_transformers(pair):
    hf, ours, case = pair
    rng = np.random.default_rng(3)
    new = 10
    single = prompt(rng, 1, 7)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(single), max_new_tokens=new, do_sample=False, pad_token_id=0,
                           eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours.generate(single, new), want)
    lengths = [12, 7, 10]  # a left-padded batch
    ids = np.zeros((3, 12), np.int64)
    mask = np.zeros((3, 12), np.int64)
    for i, n in enumerate(lengths):
        ids[i, 12 - n :] = prompt(rng, 1, n)[0]
        mask[i, 12 - n :] = 1
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours.generate(ids, new, attention_mask=mask), want)


def test_the_arrangement_and_hooks(pair):
    """The hook points keep TransformerLens's names: hook_embed is the scaled embedding,
    hook_attn_out and hook_mlp_out what the residual adds (after the sandwich norms, equal
    to transformers' post-norms' outputs); hook_attn_scores soft-capped and masked."""
    hf, ours, case = pair
    c = ours.config
    attn = ours.layers[0].attn
    assert attn.num_kv_heads == hf.config.num_key_value_heads and attn.num_heads == hf.config.num_attention_heads
    assert (attn.q_norm is not None) == case.startswith("gemma3")
    assert ("lm_head.weight" in ours.state_dict()) == (not c.tie_word_embeddings)
    assert attn.scale == pytest.approx(hf.config.query_pre_attn_scalar ** -0.5)
    names = ours.hook_names()
    order = ["blocks.0.hook_resid_pre", "blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_rot_q",
             "blocks.0.attn.hook_z", "blocks.0.ln1_post.hook_normalized", "blocks.0.hook_attn_out",
             "blocks.0.hook_resid_mid", "blocks.0.ln2.hook_normalized", "blocks.0.mlp.hook_post",
             "blocks.0.ln2_post.hook_normalized", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    ids = prompt(np.random.default_rng(4), 1, 9)
    seen = {}
    layer = hf.model.layers[1]
    handles = [layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("attn", o)),
               layer.post_feedforward_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("mlp", o)),
               hf.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.__setitem__("embed", o))]
    with torch.no_grad():
        hf(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    _, cache = ours.run_with_cache(ids)
    for ours_name, key in (("blocks.1.hook_attn_out", "attn"), ("blocks.1.hook_mlp_out", "mlp"),
                           ("hook_embed", "embed")):
        want = seen[key].numpy()
        assert np.abs(cache[ours_name] - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), ours_name
    np.testing.assert_allclose(cache["blocks.1.hook_resid_mid"] - cache["blocks.1.hook_resid_pre"],
                               cache["blocks.1.hook_attn_out"], atol=1e-4)
    scores = cache["blocks.0.attn.hook_attn_scores"]
    cap = attn.softcap
    if cap is not None:
        finite = scores[np.isfinite(scores)]
        assert np.abs(finite).max() < cap
        if "softcap" in case:  # a cap of 4: reached
            assert np.abs(finite).max() > 0.5 * cap
    assert np.isneginf(scores[0, :, 0, 1:]).all()  # the future is -inf, after the cap
    # a hook that replaces the attention's output changes what the residual receives
    zeroed = ours.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_attn_out", lambda x, name: np.zeros_like(x))])
    assert not np.allclose(zeroed, ours(ids))


# ---- the backward passes of the new slots ------------------------------------------------
@pytest.mark.parametrize("case", ["gemma2-gqa2-window-softcap", "gemma3-gqa2-window-linear"])
def test_backward_through_every_block_matches_autograd(case, tmp_path):
    """The blocks' backward passes (soft-capped grouped-query attention with a sliding
    window, sandwich norms with Gemma's 1 + weight, QK-norm, GELU-tanh gated MLP) against
    torch autograd through the transformers model, float64."""

    def close(got, want):
        want = want.detach().numpy() if hasattr(want, "detach") else want
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())

    hf = _hf_model(case, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(tmp_path)
    ours = Gemma.from_pretrained(tmp_path, dtype=np.float64)
    hf = hf.double()
    rng = np.random.default_rng(6)
    ids = prompt(rng, 2, 12)
    g_logits = rng.standard_normal((2, 12, V))
    x0_np = ours.tok_emb.weight.data[ids] * ours.embed_scale  # the scaled embeddings
    x0 = torch.tensor(x0_np, requires_grad=True)
    hf.config.final_logit_softcapping = None  # the blocks alone: logits = ln_f(x) @ W_U
    (hf(inputs_embeds=x0).logits * torch.from_numpy(g_logits)).sum().backward()
    ours.train()
    x = x0_np
    for block in ours.layers:
        x = block(x)
    h = ours.ln_f(x)
    w_out = ours.W_U.T
    close(h @ w_out.T, hf(inputs_embeds=x0).logits)
    g = ours.ln_f.backward(g_logits @ w_out)
    for block in reversed(ours.layers):
        g = block.backward(g)
    ours.eval()
    close(g, x0.grad)
    hp = dict(hf.named_parameters())
    for i, block in enumerate(ours.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        want = torch.cat([hp[a + f"{p}_proj.weight"].grad for p in "qkv"]).numpy()
        close(block.attn.in_proj_weight.grad, want)
        close(block.attn.out_proj.weight.grad, hp[a + "o_proj.weight"].grad)
        close(block.mlp.gate_proj.weight.grad, hp[m + "mlp.gate_proj.weight"].grad)
        for ours_norm, theirs in (("ln_1", "input_layernorm"), ("ln_1_post", "post_attention_layernorm"),
                                  ("ln_2", "pre_feedforward_layernorm"), ("ln_2_post", "post_feedforward_layernorm")):
            close(getattr(block, ours_norm).weight.grad, hp[m + theirs + ".weight"].grad)
        if ours.config.qk_norm:
            close(block.attn.k_norm.weight.grad, hp[a + "k_norm.weight"].grad)


@pytest.mark.parametrize(("kv_heads", "mask"), [(4, "causal"), (2, "window+padding"), (1, "float")])
def test_softcapped_attention_forward_and_backward_match_autograd(kv_heads, mask):
    """The Attention layer's soft-cap on its own: ``cap * tanh(q k^T * scale / cap)``, then
    the mask, against torch autograd (float64), the output the same with and without
    weights (the kernel path takes the explicit scores too)."""
    rng = np.random.default_rng(7)
    N, L, E, H, D, cap, scale = 2, 7, 16, 4, 6, 1.5, 0.4
    layer = Attention(E, H, num_kv_heads=kv_heads, head_dim=D, causal=mask != "float", rng=rng, dtype=np.float64,
                      softcap=cap, scale=scale, sliding_window=3 if "window" in mask else None)
    layer.in_proj_weight.data *= 3.0  # scores well past the cap
    x = rng.standard_normal((N, L, E))
    kpm = None
    attn_mask = None
    if "padding" in mask:
        kpm = np.ones((N, L), bool)
        kpm[1, 2:4] = False  # every query keeps a key in its window
    if mask == "float":
        attn_mask = rng.standard_normal((L, L))
    layer.train()
    out, weights = layer.forward_with_weights(x, key_padding_mask=kpm, attn_mask=attn_mask)
    np.testing.assert_allclose(layer(x, key_padding_mask=kpm, attn_mask=attn_mask), out, rtol=0, atol=1e-12)
    g = rng.standard_normal(out.shape)
    gx = layer.backward(g)

    xt = torch.tensor(x, requires_grad=True)
    w_in = torch.tensor(layer.in_proj_weight.data, requires_grad=True)
    w_out = torch.tensor(layer.out_proj.weight.data)
    qkv = xt @ w_in.T
    q, k, v = qkv.split([H * D, kv_heads * D, kv_heads * D], dim=-1)
    q = q.reshape(N, L, H, D).transpose(1, 2)
    k = k.reshape(N, L, kv_heads, D).transpose(1, 2).repeat_interleave(H // kv_heads, dim=1)
    v = v.reshape(N, L, kv_heads, D).transpose(1, 2).repeat_interleave(H // kv_heads, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    s = cap * torch.tanh(s / cap)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if mask == "float":
        s = s + torch.from_numpy(attn_mask)
    else:
        allowed = j <= i
        if "window" in mask:
            allowed &= j > i - 3
        allowed = np.broadcast_to(allowed, (N, 1, L, L)).copy()
        if kpm is not None:
            allowed &= kpm[:, None, None, :]
        s = s.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    p = torch.softmax(s, dim=-1)
    z = (p @ v).transpose(1, 2).reshape(N, L, H * D)
    want = z @ w_out.T + torch.tensor(layer.out_proj.bias.data)
    (want * torch.from_numpy(g)).sum().backward()
    np.testing.assert_allclose(weights, p.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(layer.in_proj_weight.grad, w_in.grad.numpy(), rtol=0, atol=1e-10)
    # without the cap the same layer computes something else: the cap is in effect
    plain = Attention(E, H, num_kv_heads=kv_heads, head_dim=D, causal=mask != "float", dtype=np.float64,
                      scale=scale, sliding_window=layer.sliding_window)
    plain.load_state_dict(layer.state_dict())
    assert np.abs(plain(x, key_padding_mask=kpm, attn_mask=attn_mask) - out).max() > 1e-3


def test_sandwich_norms_backward_and_defaults():
    """A block with post norms: its backward against finite differences of its forward
    (float64), and a block without them keeps its parameters and hook names."""
    rng = np.random.default_rng(8)
    E = 8

    def make(post: bool):
        r = np.random.default_rng(0)
        kw = dict(post_attn_norm=RMSNorm(E, add_unit_offset=True, dtype=np.float64),
                  post_mlp_norm=RMSNorm(E, add_unit_offset=True, dtype=np.float64)) if post else {}
        return TransformerBlock(E, 2, 16, rng=r, dtype=np.float64, ln_1=RMSNorm(E, dtype=np.float64),
                                ln_2=RMSNorm(E, dtype=np.float64),
                                mlp=GatedFeedForward(E, 16, activation="gelu_tanh", rng=r, dtype=np.float64), **kw)

    plain, block = make(False), make(True)
    assert sorted(block.state_dict()) == sorted(plain.state_dict() | {"ln_1_post.weight": 0, "ln_2_post.weight": 0})
    assert "ln1_post.hook_normalized" not in plain.hook_names()
    assert block.hook_names() == [n for n in block.hook_names() if n in plain.hook_names()
                                  or n.startswith(("ln1_post", "ln2_post"))]
    for n in (block.ln_1_post, block.ln_2_post):
        n.weight.data[...] = rng.standard_normal(E) * 0.3
    x = rng.standard_normal((2, 5, E))
    g = rng.standard_normal((2, 5, E))
    block.train()
    y = block(x)
    assert np.abs(y - plain(x)).max() > 1e-3
    gx = block.backward(g)
    eps = 1e-6
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[idx] = eps
        num[idx] = ((block(x + d) - block(x - d)) * g).sum() / (2 * eps)
    np.testing.assert_allclose(gx, num, rtol=1e-6, atol=1e-7)


# ---- configs, the registry and errors -----------------------------------------------
def test_registry_detects_both_and_refuses_the_multimodal_model(tmp_path):
    for kind, arch, name in (("gemma2", "Gemma2ForCausalLM", "gemma2"), ("gemma3_text", "Gemma3ForCausalLM", "gemma3")):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps({"model_type": kind, "architectures": [arch]}))
        assert detect(tmp_path / kind).name == name
    base = {**BASE, "num_attention_heads": 4}
    with pytest.raises(CheckpointError, match=r"model_type 'gemma3' .* not supported; supported: gemma2 "
                                              r"\(Gemma2ForCausalLM\), gemma3_text \(Gemma3ForCausalLM\)"):
        GemmaConfig.from_dict({**base, "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
        GemmaConfig.from_dict({**base, "model_type": "gemma3_text", "use_bidirectional_attention": True})
    with pytest.raises(CheckpointError, match="rope_scaling type 'longrope' is not supported"):
        GemmaConfig.from_dict({**base, "model_type": "gemma2", "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match="softcap must be a positive finite float"):
        Attention(8, 2, softcap=0.0)


def test_config_defaults_follow_transformers():
    """Without layer_types: Gemma 2 alternates (even layers local), Gemma 3 has five local
    layers to one global (sliding_window_pattern) and the older rope_local_base_freq."""
    base = {**BASE, "num_attention_heads": 4, "num_hidden_layers": 7, "sliding_window": 3}
    c2 = GemmaConfig.from_dict({**base, "model_type": "gemma2"})
    assert c2.sliding_windows == (3, None, 3, None, 3, None, 3)
    assert (c2.attn_logit_softcapping, c2.final_logit_softcapping, c2.attn_scale) == (None, None, 256 ** -0.5)
    c3 = GemmaConfig.from_dict({**base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert c3.sliding_windows == (3, 3, 3, 3, 3, None, 3) and c3.qk_norm
    assert c3.rope_for(0).theta == 1e4 and c3.rope_for(5).theta == 1e6
    assert c3.rope_for(5).rope_type == "linear" and c3.rope_for(0).rope_type == "default"
    for kind in ("gemma2", "gemma3_text"):  # transformers' own defaults agree
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf_cls = transformers.Gemma2Config if kind == "gemma2" else transformers.Gemma3TextConfig
            hf_types = hf_cls(**base).layer_types
        ours = GemmaConfig.from_dict({**base, "model_type": kind})
        assert [w is not None for w in ours.sliding_windows] == [t == "sliding_attention" for t in hf_types]


def test_torch_conversion_gives_the_transformers_class_and_back(pair):
    """to_torch writes Gemma as transformers' own class (the config written back, the weights
    through the name map), with the logits of both; from_torch reads it back as a Gemma."""
    from attnlab.interop import from_torch, to_torch

    hf, ours, case = pair
    ids = prompt(np.random.default_rng(4), 2, 12)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    module = to_torch(ours)
    assert type(module) is type(hf) and not module.training
    with torch.no_grad():
        got = module(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), case
    back = from_torch(hf)
    assert type(back) is Gemma and back.config == ours.config
    for name, w in ours.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], w)


def test_softcapped_attention_backward_with_dropout_matches_autograd():
    """Training with attention dropout: the backward pass redraws the forward pass's
    keep-mask (read back from the returned, dropped weights) and matches autograd."""
    rng = np.random.default_rng(9)
    N, L, E, H, Hkv, D, cap, p = 2, 6, 12, 4, 2, 5, 2.0, 0.3
    layer = Attention(E, H, num_kv_heads=Hkv, head_dim=D, causal=True, dropout=p, softcap=cap, rng=rng,
                      dtype=np.float64, bias=False)
    layer.in_proj_weight.data *= 3.0
    layer.train()
    x = rng.standard_normal((N, L, E))
    out, dropped = layer.forward_with_weights(x)
    g = rng.standard_normal(out.shape)
    gx = layer.backward(g)
    xt = torch.tensor(x, requires_grad=True)
    qkv = xt @ torch.tensor(layer.in_proj_weight.data).T
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.reshape(N, L, H, D).transpose(1, 2)
    k = k.reshape(N, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = v.reshape(N, L, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = cap * torch.tanh(q @ k.transpose(-1, -2) / np.sqrt(D) / cap)
    s = s.masked_fill(~torch.from_numpy(np.tril(np.ones((L, L), bool))), float("-inf"))
    probs = torch.softmax(s, dim=-1)
    keep = torch.from_numpy((dropped != 0) / (1 - p))
    assert (dropped[:, :, np.tril(np.ones((L, L), bool))] == 0).any()  # some visible weights were dropped
    z = (probs * keep @ v).transpose(1, 2).reshape(N, L, H * D)
    want = z @ torch.tensor(layer.out_proj.weight.data).T
    (want * torch.from_numpy(g)).sum().backward()
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=0, atol=1e-10)


def test_softcapped_layer_attends_through_its_attention_fn():
    """One route: without weights or hooks a soft-capped layer calls its attention function
    with ``softcap=`` like any other option; with weights the core's explicit steps give the
    same output."""
    from attnlab.core import scaled_dot_product_attention

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("softcap"))
        return scaled_dot_product_attention(*args, **kwargs)

    rng = np.random.default_rng(10)
    layer = Attention(12, 4, num_kv_heads=2, causal=True, softcap=2.0, rng=rng, dtype=np.float64,
                      attention_fn=recording)
    layer.in_proj_weight.data *= 3.0
    x = rng.standard_normal((2, 6, 12))
    out = layer(x)
    assert seen == [2.0]
    np.testing.assert_allclose(layer.forward_with_weights(x)[0], out, rtol=0, atol=1e-12)
    assert seen == [2.0]  # the weights' route computes the scores itself
    uncapped = Attention(12, 4, num_kv_heads=2, causal=True, rng=np.random.default_rng(10), dtype=np.float64)
    uncapped.in_proj_weight.data[...] = layer.in_proj_weight.data
    uncapped.out_proj.weight.data[...] = layer.out_proj.weight.data
    assert np.abs(uncapped(x) - out).max() > 1e-3  # the cap changes the output


def test_attention_fn_without_softcap_serves_uncapped_layers_only():
    from attnlab.core import scaled_dot_product_attention

    def plain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, rng=None):
        return scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng=rng)

    x = np.random.default_rng(11).standard_normal((1, 5, 8))
    Attention(8, 2, causal=True, attention_fn=plain, rng=np.random.default_rng(0))(x.astype(np.float32))
    capped = Attention(8, 2, causal=True, softcap=3.0, attention_fn=plain, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"this layer soft-caps its scores \(softcap=3.0\), but its attention_fn "
                                        r"plain takes no softcap= keyword"):
        capped(x.astype(np.float32))


def test_trace_output_is_the_attention_output_before_the_post_norm(pair):
    _, ours, case = pair
    ids = prompt(np.random.default_rng(3), 1, 6)[0]
    t = ours.trace(ids, layer=1)
    _, cache = ours.run_with_cache(ids[None], names_filter=["blocks.0.attn.hook_z", "blocks.0.hook_attn_out"])
    z = cache["blocks.0.attn.hook_z"]
    want = ours.layers[0].attn.out_proj(z.reshape(*z.shape[:2], -1))[0]
    np.testing.assert_array_equal(t.get("output"), want)
    # the residual receives the post-normed output, which is another array
    assert not np.allclose(t.get("output"), cache["blocks.0.hook_attn_out"][0], atol=1e-3), case
