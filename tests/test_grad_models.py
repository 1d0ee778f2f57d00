"""Gradients through every model family against torch autograd on transformers' own models
(random weights written by transformers, several shapes per family, float64 and float32):
every parameter's gradient, the gradients at the hook points both libraries have, a
left-padded batch, a sliding window shorter than the prompt, grouped-query heads 2, 3 and
4, Gemma's soft-caps, tied embeddings, every rope_scaling type, and a forward hook that
zero-ablates a head.

transformers' Llama-family code runs RMSNorm and the attention softmax in float32 even in a
float64 model; the float64 comparisons run its code with those two casts removed (the
norms' forward and an eager attention function without the upcast) and the rotary cos/sin
taken in float64 of the float32 angles transformers computes (attnlab's float64 rotary).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.models import from_pretrained  # noqa: E402
from attnlab.models.bert import BertConfig, BertEncoder  # noqa: E402
from helpers import TOL, grad_rel_err  # noqa: E402
from hf_oracle import (  # noqa: E402
    CASES,
    V,
    batch,
    folder_maker,
    parameter_grads,
    patch_eager,
    positions,
    torch_backward,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (transformers model, its saved folder), each made once."""
    return folder_maker(tmp_path_factory)


@pytest.fixture
def eager(monkeypatch):
    return patch_eager(monkeypatch)


def _retained(hf, names):
    """Forward hooks on the transformers model that keep the tensors matching attnlab's hook
    names (``retain_grad``): hook name -> getter of the tensor's gradient, and the handles."""
    kept, handles = {}, []
    layers = hf.model.layers

    def keep(name, tensor):
        if tensor.requires_grad:
            tensor.retain_grad()
        kept[name] = tensor

    handles.append(hf.model.embed_tokens.register_forward_hook(lambda m, a, out: keep("hook_embed", out)))
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: keep(f"blocks.{i}.hook_resid_pre", kwargs.get("hidden_states", args[0]
                                                                                         if args else None)),
            with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, args, i=i: keep(f"blocks.{i}.attn.hook_z", args[0])))
        handles.append(layer.self_attn.q_proj.register_forward_hook(
            lambda m, a, out, i=i: keep(f"blocks.{i}.attn.hook_q", out)))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, args, i=i: keep(f"blocks.{i}.mlp.hook_post", args[0])))
    return kept, handles


def _hf_grads(hf, ids, mask, g_logits, *, o_proj_pre=None):
    """transformers' logits and parameter gradients for ``sum(logits * g_logits)``, with the
    kept hook tensors; ``o_proj_pre`` a forward pre-hook on every layer's o_proj."""
    kept, handles = _retained(hf, [])
    if o_proj_pre is not None:
        handles += [layer.self_attn.o_proj.register_forward_pre_hook(o_proj_pre) for layer in hf.model.layers]
    return torch_backward(hf, ids, mask, g_logits, handles), kept


def _check_parameter_grads(ours, hf, tol, case):
    """Every attnlab parameter's gradient against the transformers tensors it is made of."""
    if ours.config.tie_word_embeddings:
        assert "lm_head.weight" not in type(ours).name_map(ours.config)  # one parameter, both uses
    worst = 0.0
    for name, (got, want) in parameter_grads(ours, hf).items():
        assert got is not None, name
        err = grad_rel_err(got, want)
        assert err <= tol, (case, name, err)
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_decoder_gradients_match_torch_autograd(case, dtype, folders, eager):
    """Every parameter's gradient and the gradients at hook_embed, hook_resid_pre,
    attn.hook_q, attn.hook_pattern, attn.hook_z and mlp.hook_post of a left-padded batch
    (the padded positions' logits get no gradient, as a loss leaves them out), through
    run_with_cache(incl_bwd=True) against torch autograd through the same transformers model."""
    hf, folder = folders(case)
    if dtype == np.float64:
        eager.float64()
        hf = hf.double()
    else:
        hf = hf.float()
    ours = from_pretrained(folder, dtype=dtype).train()
    rng = np.random.default_rng(3)
    T = 14 if "dynamic" in case else 11  # dynamic scaling: past max_position_embeddings=8
    ids, mask = batch(rng, T=T)
    g = (rng.standard_normal((*ids.shape, V)) * mask[..., None]).astype(dtype)
    names = ["hook_embed"] + [f"blocks.{i}.{n}" for i in range(2) for n in
                              ("hook_resid_pre", "attn.hook_q", "attn.hook_pattern", "attn.hook_z", "mlp.hook_post")]
    logits, cache = ours.run_with_cache(ids, mask, names_filter=names, incl_bwd=True, grad_out=g)
    want_logits, kept = _hf_grads(hf, ids, mask, g)
    real = mask.astype(bool)
    tol = TOL[dtype]
    assert np.abs(logits - want_logits)[real].max() <= tol * max(1.0, np.abs(want_logits).max())
    worst = _check_parameter_grads(ours, hf, tol, case)
    worst_hook = 0.0
    for name in names:
        if name.endswith("hook_pattern"):
            i = int(name.split(".")[1])
            want = eager.patterns[i].grad.numpy()
        else:
            want = kept[name].grad.numpy().reshape(cache[name].shape)
        got = cache[name + "_grad"]
        if name.endswith("hook_pattern"):  # real queries and keys: padded ones differ (their values too)
            pair = real[:, None, :, None] & real[:, None, None, :]
            got, want = got[np.broadcast_to(pair, got.shape)], want[np.broadcast_to(pair, want.shape)]
        err = grad_rel_err(got, want)
        assert err <= tol, (case, name, err)
        worst_hook = max(worst_hook, err)
    print(f"{case} {np.dtype(dtype).name}: worst parameter gradient {worst:.1e}, hook gradient {worst_hook:.1e}")


# ---- GPT-2 and BERT ----------------------------------------------------------------------------
def _gpt2_pair(tmp_path, dtype, seed=0):
    from attnlab.models import GPT2

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(vocab_size=V, n_positions=24, n_embd=32, n_layer=2, n_head=4,
                                         attn_implementation="eager")
        hf = transformers.GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.add_(torch.randn_like(p) * (0.2 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
                                              else 0.05))
        hf.save_pretrained(tmp_path)
    hf = hf.double() if dtype == np.float64 else hf
    return hf, GPT2.from_pretrained(tmp_path, dtype=dtype).train()


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_gpt2_gradients_match_torch_autograd(dtype, tmp_path):
    """Every parameter (the tied embedding's gradient is both uses', the Conv1D weights
    transposed), hook_embed, hook_resid_pre, attn.hook_z and mlp.hook_post, a left-padded
    batch."""
    from attnlab.io.names import gpt2_name_map, gpt2_transposed

    hf, ours = _gpt2_pair(tmp_path, dtype)
    rng = np.random.default_rng(4)
    ids, mask = batch(rng, T=10)
    g = (rng.standard_normal((*ids.shape, V)) * mask[..., None]).astype(dtype)
    names = ["hook_embed"] + [f"blocks.{i}.{n}" for i in range(2) for n in
                              ("hook_resid_pre", "attn.hook_z", "mlp.hook_post")]
    logits, cache = ours.run_with_cache(ids, mask, names_filter=names, incl_bwd=True, grad_out=g)
    kept, handles = {}, []

    def keep(name, t):
        t.retain_grad()
        kept[name] = t

    tr = hf.transformer
    handles.append(tr.wte.register_forward_hook(lambda m, a, out: keep("hook_embed", out)))
    for i, block in enumerate(tr.h):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: keep(f"blocks.{i}.hook_resid_pre", a[0])))
        handles.append(block.attn.c_proj.register_forward_pre_hook(lambda m, a, i=i: keep(f"blocks.{i}.attn.hook_z",
                                                                                           a[0])))
        handles.append(block.mlp.c_proj.register_forward_pre_hook(lambda m, a, i=i: keep(f"blocks.{i}.mlp.hook_post",
                                                                                          a[0])))
    out = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
             position_ids=torch.from_numpy(positions(mask)))
    (out.logits * torch.from_numpy(g)).sum().backward()
    for h in handles:
        h.remove()
    tol = TOL[dtype]
    real = mask.astype(bool)
    assert np.abs(logits - out.logits.detach().numpy())[real].max() <= tol * 10
    hp = dict(hf.named_parameters())
    transposed = gpt2_transposed(2)
    worst = [0.0, 0.0]
    for name, p in ours.named_parameters():
        (src,) = gpt2_name_map(2)[name]
        want = hp["transformer." + src].grad.numpy()
        err = grad_rel_err(p.grad, want.T if name in transposed else want)
        assert err <= tol, (name, err)
        worst[0] = max(worst[0], err)
    for name in names:
        err = grad_rel_err(cache[name + "_grad"], kept[name].grad.numpy().reshape(cache[name].shape))
        assert err <= tol, (name, err)
        worst[1] = max(worst[1], err)
    print(f"gpt2 {np.dtype(dtype).name}: worst parameter gradient {worst[0]:.1e}, hook gradient {worst[1]:.1e}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_bert_gradients_match_torch_autograd(dtype):
    """BertEncoder.backward(dL/d last_hidden_state): every parameter, the embeddings' three
    tables, hook_embed and hook_resid_pre, a padded batch (padded positions included: they
    are computed as transformers computes them)."""
    from attnlab.io.names import bert_name_map

    torch.manual_seed(1)
    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               max_position_embeddings=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.BertModel(transformers.BertConfig(**cfg, attn_implementation="eager"),
                                    add_pooling_layer=False).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf = hf.double() if dtype == np.float64 else hf
    weights = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    ours = BertEncoder(BertConfig(**cfg), weights=weights, dtype=dtype).train()
    rng = np.random.default_rng(5)
    ids = rng.integers(5, V, (2, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    g = rng.standard_normal((2, 9, 32)).astype(dtype)
    out, cache = ours.run_with_cache(ids, mask, names_filter=["embed.hook_embed", "blocks.1.hook_resid_pre"],
                                     incl_bwd=True, grad_out=g)
    kept = {}

    def keep(name, t):
        t.retain_grad()
        kept[name] = t

    h1 = hf.embeddings.word_embeddings.register_forward_hook(lambda m, a, o: keep("embed.hook_embed", o))
    h2 = hf.encoder.layer[1].register_forward_pre_hook(lambda m, a: keep("blocks.1.hook_resid_pre", a[0]))
    theirs = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    (theirs * torch.from_numpy(g)).sum().backward()
    h1.remove()
    h2.remove()
    tol = TOL[dtype]
    assert np.abs(out.last_hidden_state - theirs.detach().numpy()).max() <= tol * 10
    hp = dict(hf.named_parameters())
    worst = [0.0, 0.0]
    for name, p in ours.named_parameters():
        want = np.concatenate([hp[t].grad.numpy() for t in bert_name_map(2)[name]])
        err = grad_rel_err(p.grad, want)
        assert err <= tol, (name, err)
        worst[0] = max(worst[0], err)
    for name in kept:
        err = grad_rel_err(cache[name + "_grad"], kept[name].grad.numpy())
        assert err <= tol, name
        worst[1] = max(worst[1], err)
    print(f"bert {np.dtype(dtype).name}: worst parameter gradient {worst[0]:.1e}, hook gradient {worst[1]:.1e}")
