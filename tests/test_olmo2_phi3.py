"""OLMo-2 and Phi-3 against transformers: random-weight models written with save_pretrained
and loaded through the model registry (several shapes: grouped-query heads 2 and 3,
multi-head; biases; tied and untied embeddings; linear rotary scaling; Phi-3's sliding
window shorter than the prompt and partial rotary embedding).

- logits of left-padded batches of several shapes within 1e-4 (float32);
- every parameter's gradient and the gradients at the hook points both libraries have
  within 1e-9 relative in float64 (transformers' float32 casts of RMSNorm and the softmax
  removed, as in test_grad_models) and 1e-4 in float32; a forward hook that zero-ablates
  a head has torch's gradient;
- the hook points (no pre-norm in OLMo-2: its norms after the sublayers are what the
  residual adds), run_with_cache, generation with and without the cache;
- OLMo-2's QK-norm over the whole projection, Phi-3's fused projections split at load;
- bad files: one CheckpointError from the header or the config.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.io.safetensors import read_header, save_tensors  # noqa: E402
from attnlab.models import from_pretrained  # noqa: E402
from attnlab.models.olmo2 import NoNorm, Olmo2, Olmo2Config  # noqa: E402
from attnlab.models.phi3 import Phi3, Phi3Config  # noqa: E402
from attnlab.models.registry import detect  # noqa: E402
from helpers import TOL, grad_rel_err  # noqa: E402
from hf_oracle import (  # noqa: E402
    BASE,
    V,
    batch,
    folder_maker,
    parameter_grads,
    patch_eager,
    positions,
    torch_backward,
)

# id -> (transformers config class, options)
CASES = {
    "olmo2-gqa2-bias-tied": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                                 tie_word_embeddings=True)),
    "olmo2-mha-linear": ("Olmo2Config", dict(num_attention_heads=4, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "phi3-gqa2-window-partial": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                                    partial_rotary_factor=0.5)),
    "phi3-gqa3-tied": ("Phi3Config", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                                          tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (transformers model, its saved folder), each made once."""
    return folder_maker(tmp_path_factory, CASES)


@pytest.fixture
def eager(monkeypatch):
    return patch_eager(monkeypatch, modules=("olmo2", "phi3"))


def _padded(rng, B, T, pads):
    ids = rng.integers(3, V, (B, T))
    mask = np.ones((B, T), np.int64)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
        ids[i, :p] = 0
    return ids, mask


# ---- logits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, folders):
    """float32, through the registry: one sequence, and left-padded batches of two shapes."""
    hf, folder = folders(case)
    hf = hf.float()
    ours = from_pretrained(folder)
    assert type(ours) is (Olmo2 if case.startswith("olmo2") else Phi3)
    rng = np.random.default_rng(1)
    worst = 0.0
    for B, T, pads in ((1, 7, (0,)), (3, 13, (0, 4, 9)), (2, 16, (5, 0))):
        ids, mask = _padded(rng, B, T, pads)
        with torch.no_grad():
            want = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      position_ids=torch.from_numpy(positions(mask))).logits.numpy()
        got = ours(ids, attention_mask=mask)
        real = mask.astype(bool)
        scale = max(1.0, np.abs(want).max())
        err = np.abs(got - want)[real].max() / scale
        assert err <= 1e-4, (case, B, T, err)
        assert np.abs(want).max() > 1.0  # not all near zero
        worst = max(worst, err)
    print(f"{case} float32: worst logit error {worst:.1e} (relative to the largest logit)")


# ---- gradients ---------------------------------------------------------------------------------
HOOKS = ("hook_resid_pre", "attn.hook_q", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "mlp.hook_post",
         "hook_mlp_out")


def _retained(hf, olmo2: bool):
    """Forward hooks on the transformers model keeping (``retain_grad``) the tensors of
    attnlab's hook points: name -> tensor, and the handles."""
    kept, handles = {}, []

    def keep(name, tensor):
        if tensor.requires_grad:
            tensor.retain_grad()
        kept[name] = tensor

    def on(module, name, *, pre=False):
        if pre:
            handles.append(module.register_forward_pre_hook(lambda m, args: keep(name, args[0])))
        else:
            handles.append(module.register_forward_hook(lambda m, a, out: keep(name, out)))

    on(hf.model.embed_tokens, "hook_embed")
    for i, layer in enumerate(hf.model.layers):
        b = f"blocks.{i}."
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, b=b: keep(b + "hook_resid_pre", kwargs.get("hidden_states", args[0] if args
                                                                                else None)), with_kwargs=True))
        attn = layer.self_attn
        on(attn.q_proj if olmo2 else attn.qkv_proj, b + "q_projection")  # hook_q: its first H D columns
        on(attn.o_proj, b + "attn.hook_z", pre=True)
        on(layer.mlp.down_proj, b + "mlp.hook_post", pre=True)
        # what the residual adds: OLMo-2's norms after the sublayers, Phi-3's sublayer outputs
        on(layer.post_attention_layernorm if olmo2 else attn.o_proj, b + "hook_attn_out")
        on(layer.post_feedforward_layernorm if olmo2 else layer.mlp.down_proj, b + "hook_mlp_out")
    return kept, handles


def _torch_grads(hf, ids, mask, g, extra=()):
    kept, handles = _retained(hf, "Olmo2" in type(hf).__name__)
    return torch_backward(hf, ids, mask, g, handles + list(extra)), kept


def _compare_parameters(ours, hf, tol, case):
    """Every attnlab parameter's gradient against the transformers tensors (or their rows,
    for Phi-3's gate_up_proj) it is made of; every transformers tensor with a gradient used."""
    worst = 0.0
    for name, (got, want) in parameter_grads(ours, hf).items():
        err = grad_rel_err(got, want)
        assert err <= tol, (case, name, err)
        worst = max(worst, err)
    return worst


def _pair(case, dtype, folders, eager):
    hf, folder = folders(case)
    if dtype == np.float64:
        eager.float64()
        hf = hf.double()
    else:
        hf = hf.float()
    return hf, from_pretrained(folder, dtype=dtype).train()


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_torch_autograd(case, dtype, folders, eager):
    """Every parameter's gradient and the gradients at hook_embed and each block's
    hook_resid_pre, attn.hook_q, hook_pattern, hook_z, hook_attn_out, mlp.hook_post and
    hook_mlp_out of a left-padded batch, through run_with_cache(incl_bwd=True)."""
    hf, ours = _pair(case, dtype, folders, eager)
    rng = np.random.default_rng(3)
    ids, mask = batch(rng, T=11)
    g = (rng.standard_normal((*ids.shape, V)) * mask[..., None]).astype(dtype)
    names = ["hook_embed"] + [f"blocks.{i}.{n}" for i in range(2) for n in HOOKS]
    logits, cache = ours.run_with_cache(ids, mask, names_filter=names, incl_bwd=True, grad_out=g)
    want_logits, kept = _torch_grads(hf, ids, mask, g)
    real = mask.astype(bool)
    tol = TOL[dtype]
    assert np.abs(logits - want_logits)[real].max() <= tol * max(1.0, np.abs(want_logits).max())
    worst = _compare_parameters(ours, hf, tol, case)
    H, D = ours.config.num_attention_heads, ours.config.head_size
    worst_hook = 0.0
    for name in names:
        got = cache[name + "_grad"]
        if name.endswith("hook_pattern"):  # real queries and keys (padded ones differ)
            want = eager.patterns[int(name.split(".")[1])].grad.numpy()
            pair = np.broadcast_to(real[:, None, :, None] & real[:, None, None, :], got.shape)
            got, want = got[pair], want[pair]
        elif name.endswith("hook_q"):
            want = kept[name.replace("attn.hook_q", "q_projection")].grad.numpy()[..., : H * D].reshape(got.shape)
        else:
            want = kept[name].grad.numpy().reshape(got.shape)
        err = grad_rel_err(got, want)
        assert err <= tol, (case, name, err)
        worst_hook = max(worst_hook, err)
    print(f"{case} {np.dtype(dtype).name}: worst parameter gradient {worst:.1e}, hook gradient {worst_hook:.1e}")


@pytest.mark.parametrize("case", ["olmo2-gqa2-bias-tied", "phi3-gqa3-tied"])
def test_a_head_zero_ablated_by_a_hook_has_torchs_gradient(case, folders, eager):
    """A forward hook on blocks.0.attn.hook_z zeroes head 1: every parameter's gradient
    equals torch's with the same hook (a pre-hook on o_proj), float64. Phi-3: the head's
    query rows get no gradient; OLMo-2: they do, as its QK-norm's statistics span every
    head (the head's queries scale the other heads')."""
    hf, ours = _pair(case, np.float64, folders, eager)
    rng = np.random.default_rng(8)
    ids, mask = batch(rng, T=9)
    g = rng.standard_normal((*ids.shape, V)) * mask[..., None]
    H, D = ours.config.num_attention_heads, ours.config.head_size
    head = 1

    def ablate(z, name):
        z = z.copy()
        z[:, :, head] = 0.0
        return z

    logits = ours.run_with_hooks(ids, mask, fwd_hooks=[("blocks.0.attn.hook_z", ablate)])
    ours.backward(g)

    def pre(module, args):
        x = args[0].clone()
        B, T, _ = x.shape
        x.view(B, T, H, D)[:, :, head] = 0.0
        return (x,)

    handle = hf.model.layers[0].self_attn.o_proj.register_forward_pre_hook(pre)
    want, _ = _torch_grads(hf, ids, mask, g, extra=[handle])
    real = mask.astype(bool)
    assert np.abs(logits - want)[real].max() <= 1e-9 * np.abs(want).max()
    _compare_parameters(ours, hf, TOL[np.float64], case)
    w = ours.layers[0].attn.in_proj_weight.grad
    assert w[:D].any()
    assert w[head * D:(head + 1) * D].any() == case.startswith("olmo2")


# ---- the arrangement, hooks, cache and generation ----------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_arrangement_parameters_and_hooks(case, folders):
    """As many parameters as transformers' model; OLMo-2: no pre-norm, norms after the
    sublayers (hook_attn_out and hook_mlp_out equal transformers' post-norm outputs), QK-norm
    weights over the whole projection; Phi-3: Llama's arrangement with the fused projections
    split. The weights also load from a dict of transformers' tensors."""
    hf, folder = folders(case)
    hf = hf.float()  # (a gradient test may have left it in float64)
    ours = from_pretrained(folder)
    c = ours.config
    H, Hkv, D = c.num_attention_heads, c.kv_heads, c.head_size
    assert sum(p.data.size for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    block = ours.layers[0]
    names = ours.hook_names()
    ids = np.random.default_rng(4).integers(3, V, (2, 9))
    seen = {}
    layer = hf.model.layers[1]
    olmo2 = case.startswith("olmo2")
    handles = [(layer.post_attention_layernorm if olmo2 else layer.self_attn.o_proj).register_forward_hook(
        lambda m, i, o: seen.__setitem__("attn", o)),
        (layer.post_feedforward_layernorm if olmo2 else layer.mlp).register_forward_hook(
        lambda m, i, o: seen.__setitem__("mlp", o))]
    with torch.no_grad():
        hf(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    logits, cache = ours.run_with_cache(ids)
    np.testing.assert_array_equal(logits, ours(ids))
    for ours_name, key in (("blocks.1.hook_attn_out", "attn"), ("blocks.1.hook_mlp_out", "mlp")):
        want = seen[key].numpy()
        assert np.abs(cache[ours_name] - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), ours_name
    np.testing.assert_allclose(cache["blocks.1.hook_resid_mid"] - cache["blocks.1.hook_resid_pre"],
                               cache["blocks.1.hook_attn_out"], atol=1e-5)
    if olmo2:
        assert isinstance(block.ln_1, NoNorm) and isinstance(block.ln_2, NoNorm)
        assert "blocks.0.ln1.hook_normalized" not in names and "blocks.0.ln1_post.hook_normalized" in names
        assert block.attn.q_norm.weight.shape == (H * D,) and block.attn.k_norm.weight.shape == (Hkv * D,)
        np.testing.assert_array_equal(block.attn.q_norm.weight.data,
                                      hf.model.layers[0].self_attn.q_norm.weight.detach().numpy())
        # the norm's statistics are over every head at once (position 0: the rotation is the identity)
        q = cache["blocks.0.attn.hook_q"][:, 0].astype(np.float64)  # (B, H, D)
        w, eps = block.attn.q_norm.weight.data.reshape(H, D), c.rms_norm_eps
        whole = q / np.sqrt((q ** 2).mean(axis=(-2, -1), keepdims=True) + eps) * w
        per_head = q / np.sqrt((q ** 2).mean(axis=-1, keepdims=True) + eps) * w
        got = cache["blocks.0.attn.hook_rot_q"][:, 0]
        assert np.abs(got - whole).max() < 1e-4 * np.abs(whole).max() < np.abs(got - per_head).max()
    else:
        assert block.ln_1_post is None and block.attn.q_norm is None
        F = c.intermediate_size
        gate_up = hf.model.layers[0].mlp.gate_up_proj.weight.detach().numpy()
        np.testing.assert_array_equal(block.mlp.gate_proj.weight.data, gate_up[:F])
        np.testing.assert_array_equal(block.mlp.up_proj.weight.data, gate_up[F:])
        np.testing.assert_array_equal(block.attn.in_proj_weight.data,
                                      hf.model.layers[0].self_attn.qkv_proj.weight.detach().numpy())
        assert c.window(0) == hf.config.sliding_window
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    again = type(ours)(c, weights=state)
    np.testing.assert_array_equal(again(ids), logits)
    if not olmo2:  # a fused tensor with rows to spare is refused, not read in part
        name = "model.layers.1.mlp.gate_up_proj.weight"
        state[name] = np.concatenate([state[name], state[name][:1]])
        with pytest.raises(CheckpointError, match=rf"{name} has shape \({2 * F + 1}, .*take {2 * F} rows"):
            type(ours)(c, weights=state)


@pytest.mark.parametrize("case", ["olmo2-gqa2-bias-tied", "phi3-gqa2-window-partial"])
def test_generation_with_the_cache_equals_without(case, folders):
    """Cached steps give the logits of a full recompute (past Phi-3's window); greedy
    generation of a left-padded batch equals a loop that recomputes every step without a
    cache, and transformers' generate."""
    hf, folder = folders(case)
    hf = hf.float()
    ours = from_pretrained(folder)
    rng = np.random.default_rng(5)
    ids, mask = _padded(rng, 2, 12, (4, 0))
    full = ours(ids, attention_mask=mask)
    cache = ours.new_cache()
    parts = [ours(ids[:, :6], attention_mask=mask[:, :6], cache=cache)]
    for t in range(6, 12):
        parts.append(ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache))
    stepped = np.concatenate(parts, axis=1)
    real = mask.astype(bool)
    assert np.abs(stepped - full)[real].max() <= 1e-5 * max(1.0, np.abs(full).max())
    new = 8
    got = ours.generate(ids, new, attention_mask=mask)
    seq, m = ids.copy(), mask.copy()
    for _ in range(new):  # no cache: the whole sequence each step
        nxt = ours(seq, attention_mask=m)[:, -1].argmax(-1)
        seq, m = np.concatenate([seq, nxt[:, None]], 1), np.concatenate([m, np.ones((2, 1), m.dtype)], 1)
    np.testing.assert_array_equal(got, seq)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(got, want)


# ---- files and configs -------------------------------------------------------------------------
def _copy(folder, tmp_path, *, config=None, tensors=None):
    """A copy of a saved folder with config.json's fields and some tensors replaced."""
    from attnlab.io.safetensors import load_tensors

    data = json.loads((folder / "config.json").read_text())
    data.update(config or {})
    (tmp_path / "config.json").write_text(json.dumps(data))
    names = list(read_header(folder / "model.safetensors")[0])
    arrays = load_tensors(folder / "model.safetensors", names)
    arrays.update(tensors or {})
    save_tensors(tmp_path / "model.safetensors", {k: v for k, v in arrays.items() if v is not None})
    return tmp_path


def test_registry_detects_both_families(folders):
    for case, name, cls in (("olmo2-mha-linear", "olmo2", Olmo2), ("phi3-gqa3-tied", "phi3", Phi3)):
        _, folder = folders(case)
        family = detect(folder)
        assert family.name == name and family.model_class() is cls


@pytest.mark.parametrize("bad, match", [
    ("olmo2 q_norm per head", r"q_norm\.weight has shape \(8,\).*num_attention_heads x head_dim"),
    ("olmo2 heads", r"hidden_size=32 is not a multiple of num_attention_heads=5"),
    ("olmo2 missing post norm", r"missing tensor\(s\) model\.layers\.1\.post_feedforward_layernorm\.weight"),
    ("olmo2 architecture", r"architectures \['Phi3ForCausalLM'\] is not supported"),
    ("phi3 qkv", r"qkv_proj\.weight has shape \(48, 32\).*num_attention_heads x head_dim \+ num_key_value_heads"),
    ("phi3 gate_up", r"gate_up_proj\.weight has shape \(48, 32\).*intermediate_size \+ intermediate_size"),
    ("phi3 longrope", r"rope_parameters type 'longrope' is not supported for Phi-3"),
    ("phi3 yarn", r"rope_scaling type 'yarn' is not supported for Phi-3"),
    ("phi3 window", r"sliding_window must be a positive integer"),
])
def test_bad_files_raise_one_checkpoint_error(bad, match, folders, tmp_path):
    """Each refused from the config or the safetensors header before a tensor is read."""
    olmo2 = bad.startswith("olmo2")
    _, folder = folders("olmo2-gqa2-bias-tied" if olmo2 else "phi3-gqa2-window-partial")
    h = "model.layers.1."
    changes = {
        "olmo2 q_norm per head": dict(tensors={h + "self_attn.q_norm.weight": np.ones(8, np.float32)}),
        "olmo2 heads": dict(config={"num_attention_heads": 5, "num_key_value_heads": 5}),
        "olmo2 missing post norm": dict(tensors={h + "post_feedforward_layernorm.weight": None}),
        "olmo2 architecture": dict(config={"architectures": ["Phi3ForCausalLM"]}),
        "phi3 qkv": dict(tensors={h + "self_attn.qkv_proj.weight": np.zeros((48, 32), np.float32)}),
        "phi3 gate_up": dict(tensors={h + "mlp.gate_up_proj.weight": np.zeros((48, 32), np.float32)}),
        "phi3 longrope": dict(config={"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0] * 2, "long_factor": [1.0] * 2}}),
        "phi3 yarn": dict(config={"rope_scaling": {"type": "yarn", "factor": 2.0}}),
        "phi3 window": dict(config={"sliding_window": -3}),
    }[bad]
    bad_folder = _copy(folder, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(bad_folder)


def test_configs_from_transformers_defaults():
    """transformers' own default configs read as they are meant: OLMo-2's QK-norm and
    biases, Phi-3's window on every layer, its partial rotary factor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        olmo = transformers.Olmo2Config(**BASE, num_attention_heads=4, attention_bias=True).to_dict()
        phi = transformers.Phi3Config(**BASE, num_attention_heads=4, sliding_window=7,
                                      partial_rotary_factor=0.5).to_dict()
    o = Olmo2Config.from_dict({**olmo, "architectures": ["Olmo2ForCausalLM"]})
    assert o.qk_norm and o.qkv_bias and o.out_bias and not o.mlp_bias and o.sliding_windows is None
    p = Phi3Config.from_dict({**phi, "architectures": ["Phi3ForCausalLM"]})
    assert p.sliding_windows == (7, 7) and p.rope.rotary_dim == 4 and not p.qkv_bias and not p.qk_norm
    with pytest.raises(CheckpointError, match="model_type 'olmo2'"):
        Phi3Config.from_dict({**olmo, "architectures": ["Olmo2ForCausalLM"]})
