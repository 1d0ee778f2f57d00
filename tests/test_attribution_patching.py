"""Attribution patching (AtP, AtP*) against torch autograd on transformers' own models: the
activations of every hook kind on the clean and the corrupted run and the metric's gradient
at the clean run, taken from the torch model with module hooks and ``retain_grad``, give
``(a_clean - a_corrupted) . grad`` per cell; attnlab's must equal it (float32, within 1e-5
of the largest cell) on random-weight GPT-2 and grouped-query Llama models and on SmolLM2.
AtP*'s recomputed softmax is checked against the pattern of a real patched run, GradDrop
against torch with the gradient of one block's outputs dropped."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.inspect import activation_patching, attribution_patching, logit_diff  # noqa: E402
from attnlab.inspect._grad import run_with_grads  # noqa: E402
from attnlab.models import GPT2, GPT2Config, from_pretrained  # noqa: E402
from helpers import random_gpt2, random_llama  # noqa: E402

KINDS = ["resid_pre", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v", "rot_q", "rot_k"]
GOOD, BAD = 5, 9


class _Capture:
    """The activations of attnlab's hook kinds in a transformers decoder, kept with their
    gradients: ``run(ids)`` -> ``{kind: [tensor per block]}`` in attnlab's layouts."""

    def __init__(self, hf, monkeypatch, good: int = GOOD, bad: int = BAD):
        self.hf, self.acts, self.good, self.bad = hf, {}, good, bad
        self.gpt2 = hasattr(hf, "transformer")
        hf.config._attn_implementation = "eager"
        family = "gpt2" if self.gpt2 else "llama"
        modeling = getattr(getattr(transformers.models, family), f"modeling_{family}")
        original = modeling.eager_attention_forward
        capture = self

        def eager(module, query, key, value, *args, **kwargs):
            out, w = original(module, query, key, value, *args, **kwargs)
            l = module.layer_idx
            capture._keep("pattern", l, w)  # (B, H, T, S)
            capture._keep("rot_q", l, query)  # (B, H, T, D), after the rotation
            capture._keep("rot_k", l, key)
            return out, w

        monkeypatch.setattr(modeling, "eager_attention_forward", eager)

    def _keep(self, kind, layer, t):
        if t.requires_grad:
            t.retain_grad()
        self.acts.setdefault(kind, {})[layer] = t

    def run(self, ids, grad: bool):
        hf, self.acts = self.hf, {}
        layers = hf.transformer.h if self.gpt2 else hf.model.layers
        handles = []
        for l, layer in enumerate(layers):
            attn, mlp = (layer.attn, layer.mlp) if self.gpt2 else (layer.self_attn, layer.mlp)
            out_proj = attn.c_proj if self.gpt2 else attn.o_proj

            def pre(m, args, kwargs, l=l):
                self._keep("resid_pre", l, kwargs.get("hidden_states", args[0] if args else None))

            def z(m, args, l=l, H=attn.num_heads if self.gpt2 else hf.config.num_attention_heads):
                x = args[0]
                self._keep("z_flat", l, x)
                self.acts.setdefault("z", {})[l] = x  # reshaped below, after the backward pass

            handles += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                        out_proj.register_forward_pre_hook(z),
                        attn.register_forward_hook(lambda m, a, out, l=l: self._keep("attn_out", l, out[0])),
                        mlp.register_forward_hook(lambda m, a, out, l=l: self._keep("mlp_out", l, out))]
            if self.gpt2:
                handles.append(attn.c_attn.register_forward_hook(lambda m, a, out, l=l: self._keep("qkv", l, out)))
            else:
                for p in "qkv":
                    proj = getattr(attn, f"{p}_proj")
                    handles.append(proj.register_forward_hook(lambda m, a, out, l=l, p=p: self._keep(p, l, out)))
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                logits = hf(torch.from_numpy(ids)).logits
                if grad:
                    (logits[:, -1, self.good] - logits[:, -1, self.bad]).mean().backward()
        finally:
            for h in handles:
                h.remove()
        return self._layouts(grad)

    def _layouts(self, grad: bool):
        """Each kind's value (and gradient) per block, as NumPy arrays in attnlab's layout."""
        cfg = self.hf.config
        H = cfg.num_attention_heads if not self.gpt2 else cfg.n_head
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        out = {}
        for kind, per in self.acts.items():
            if kind in ("z", "qkv"):
                continue
            for l, t in per.items():
                v = t.detach().numpy()
                g = t.grad.numpy() if grad else None
                if kind.startswith("rot_"):  # (B, H, T, D) -> attnlab's (B, T, H, D)
                    v, g = v.transpose(0, 2, 1, 3), None if g is None else g.transpose(0, 2, 1, 3)
                if kind == "z_flat":
                    kind_, shape = "z", (*v.shape[:2], H, -1)
                elif kind in "qkv":
                    kind_, shape = kind, (*v.shape[:2], H if kind == "q" else Hkv, -1)
                else:
                    kind_, shape = kind, v.shape
                out.setdefault(kind_, {})[l] = (v.reshape(shape), None if g is None else g.reshape(shape))
        if self.gpt2:  # c_attn's output (B, T, 3E): q, k, v side by side
            for l, t in self.acts["qkv"].items():
                v, g = t.detach().numpy(), (t.grad.numpy() if grad else None)
                E = v.shape[-1] // 3
                for i, kind in enumerate("qkv"):
                    cut = slice(i * E, (i + 1) * E)
                    out.setdefault(kind, {})[l] = (v[..., cut].reshape(*v.shape[:2], H, -1),
                                                   None if g is None else g[..., cut].reshape(*v.shape[:2], H, -1))
        return out


def _cells(kind, a, by_position=False):
    """attnlab's cells of one block's (a_clean - a_corrupted) * grad."""
    a = a.astype(np.float64)
    if kind in ("resid_pre", "attn_out", "mlp_out"):
        return a.sum(axis=(0, 2))
    if kind == "pattern":
        return a.sum(axis=(0, 3)).T if by_position else a.sum(axis=(0, 2, 3))
    return a.sum(axis=(0, 3)) if by_position else a.sum(axis=(0, 1, 3))


def _reference(capture, clean, corrupted, kinds, by_position=False, gradient_at="clean"):
    """torch's ``(a_clean - a_corrupted) . grad`` per cell, the gradient at ``gradient_at``."""
    at_clean = gradient_at == "clean"
    c = capture.run(clean, grad=at_clean)
    x = capture.run(corrupted, grad=not at_clean)
    g = c if at_clean else x
    return {kind: np.stack([_cells(kind, (c[kind][l][0] - x[kind][l][0]) * g[kind][l][1], by_position)
                            for l in sorted(c[kind])]) for kind in kinds}


def _err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        hf = random_gpt2(folder, seed=1, n_layer=2, n_head=3, n_embd=24, vocab_size=40)
    else:
        hf = random_llama(folder, seed=2, vocab_size=40, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=6, num_key_value_heads=2, scale=4.0)
    rng = np.random.default_rng(7)
    clean = rng.integers(10, 40, size=(2, 8))
    corrupted = clean.copy()
    corrupted[:, 3] = (corrupted[:, 3] + 5) % 40
    corrupted[0, 5] = 12
    return from_pretrained(folder), hf, clean, corrupted, folder


def test_atp_equals_torch_autograd_for_every_hook_kind(pair, monkeypatch):
    ours, hf, clean, corrupted, _ = pair
    gpt2 = isinstance(ours, GPT2)
    kinds = [k for k in KINDS if not (gpt2 and k.startswith("rot_"))]
    ref = _reference(_Capture(hf, monkeypatch), clean, corrupted, kinds)
    ref_pos = _reference(_Capture(hf, monkeypatch), clean, corrupted, ["z", "pattern", "k"], by_position=True)
    metric = logit_diff(GOOD, BAD)
    for kind in kinds:
        got = attribution_patching(ours, clean, corrupted, metric, hook=kind)
        assert got.shape == ref[kind].shape, kind
        assert _err(got, ref[kind]) <= 1e-5, (kind, _err(got, ref[kind]))
    for kind in ref_pos:
        got = attribution_patching(ours, clean, corrupted, metric, hook=kind, by_position=True)
        assert _err(got, ref_pos[kind]) <= 1e-5, (kind, _err(got, ref_pos[kind]))


def test_atp_equals_torch_autograd_on_smollm2(smollm2_model, hf_smollm2, monkeypatch):
    hf, tok = hf_smollm2
    clean, _ = smollm2_model.encode("When Mary and John went to the store, John gave a drink to")
    corrupted, _ = smollm2_model.encode("When Mary and John went to the store, Mary gave a drink to")
    assert clean.shape == corrupted.shape
    good, bad = tok.encode(" Mary")[-1], tok.encode(" John")[-1]
    ref = _reference(_Capture(hf, monkeypatch, good, bad), clean[None], corrupted[None], KINDS)
    for kind in KINDS:
        got = attribution_patching(smollm2_model, clean[None], corrupted[None], logit_diff(good, bad), hook=kind)
        assert _err(got, ref[kind]) <= 1e-5, (kind, _err(got, ref[kind]))
        if kind == "resid_pre":  # the exact computation's ranking: the same top 20, rank correlation >= 0.99
            top = lambda x: set(np.argsort(-np.abs(x), axis=None)[:20].tolist())  # noqa: E731
            ranks = lambda x: np.argsort(np.argsort(x, axis=None))  # noqa: E731
            assert top(got) == top(ref[kind])
            assert np.corrcoef(ranks(got), ranks(ref[kind]))[0, 1] >= 0.99


def test_the_denoising_form_is_the_gradient_at_the_corrupted_run(pair, monkeypatch):
    ours, hf, clean, corrupted, _ = pair
    kinds = ["resid_pre", "z", "pattern", "v"]
    ref = _reference(_Capture(hf, monkeypatch), clean, corrupted, kinds, gradient_at="corrupted")
    for kind in kinds:
        got = attribution_patching(ours, clean, corrupted, logit_diff(GOOD, BAD), hook=kind, gradient_at="corrupted")
        assert _err(got, ref[kind]) <= 1e-5, kind


def test_atp_star_recomputes_the_pattern_a_patched_run_has(pair):
    """AtP*'s query and key cells: the attention weights of the patched query or key,
    recomputed, equal those of a real run with that one query or key patched; the estimate
    is then (weights - patched weights) . d metric / d weights (float64: the differences of
    nearly equal weights)."""
    _, _, clean, corrupted, folder = pair
    ours = from_pretrained(folder, dtype=np.float64)
    metric = logit_diff(GOOD, BAD)
    N = len(ours.layers)
    pn = [f"blocks.{i}.attn.hook_pattern" for i in range(N)]
    _, _, acts, grads = run_with_grads(ours, clean, metric, pn)
    names = [f"blocks.{i}.attn.hook_{x}" for i in range(N) for x in "qk"]
    _, cc = ours.run_with_cache(corrupted, names_filter=names)
    for kind in "qk":
        for by_position in (False, True):
            got = attribution_patching(ours, clean, corrupted, metric, hook=kind, method="atp*", graddrop=False,
                                       by_position=by_position)
            want = np.zeros_like(got)
            for i in range(N):
                name = f"blocks.{i}.attn.hook_{kind}"
                for cell in np.ndindex(*got.shape[1:]):
                    sl = (slice(None), *cell, slice(None)) if by_position else (slice(None), slice(None), *cell)

                    def patch(a, _name, sl=sl, src=cc[name]):
                        a = a.copy()
                        a[sl] = src[sl]
                        return a

                    seen = {}

                    def keep(a, name, seen=seen):
                        seen[name] = a.copy()

                    ours.run_with_hooks(clean, fwd_hooks=[(name, patch), (pn[i], keep)])
                    want[(i, *cell)] = ((acts[pn[i]] - seen[pn[i]]) * grads[pn[i]]).sum()
            assert _err(got, want) <= 1e-9, (kind, by_position, _err(got, want))


def test_graddrop_equals_torch_with_one_blocks_gradient_dropped(pair, monkeypatch):
    """AtP* with GradDrop: sum over blocks l of |(a_clean - a_corrupted) . grad_l| / (N - 1),
    grad_l the gradient with none through block l's attention and MLP outputs (torch: hooks
    that zero those outputs' gradients)."""
    ours, hf, clean, corrupted, _ = pair
    capture = _Capture(hf, monkeypatch)
    layers = hf.transformer.h if capture.gpt2 else hf.model.layers
    N = len(layers)
    corr = capture.run(corrupted, grad=False)
    total = {k: 0.0 for k in ("resid_pre", "v")}
    for drop in range(N):
        attn = layers[drop].attn if capture.gpt2 else layers[drop].self_attn

        def zero_grad(m, a, out):
            t = out[0] if isinstance(out, tuple) else out
            t.register_hook(torch.zeros_like)

        handles = [attn.register_forward_hook(zero_grad), layers[drop].mlp.register_forward_hook(zero_grad)]
        try:
            clean_run = capture.run(clean, grad=True)
        finally:
            for h in handles:
                h.remove()
        for kind in total:
            est = np.stack([_cells(kind, (clean_run[kind][l][0] - corr[kind][l][0]) * clean_run[kind][l][1])
                            for l in range(N)])
            total[kind] = total[kind] + np.abs(est)
    metric = logit_diff(GOOD, BAD)
    for kind, want in total.items():
        got = attribution_patching(ours, clean, corrupted, metric, hook=kind, method="atp*")
        assert _err(got, want / (N - 1)) <= 1e-5, kind


def test_activation_patching_of_every_kind_runs_the_patched_model():
    """Each cell of activation_patching is the metric of a run with that slice replaced by the
    clean run's (checked by hand for the new kinds), and with metrics from attnlab.inspect."""
    model = GPT2(GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(1))
    clean, corrupted = np.array([[1, 2, 3, 4, 5]]), np.array([[1, 2, 9, 4, 5]])
    metric = logit_diff(7, 8)
    _, cc = model.run_with_cache(clean)
    for kind, name, sl in [("pattern", "blocks.1.attn.hook_pattern", (slice(None), 1)),
                           ("q", "blocks.0.attn.hook_q", (slice(None), slice(None), 0)),
                           ("k", "blocks.1.attn.hook_k", (slice(None), 3, 1)),
                           ("v", "blocks.1.attn.hook_v", (slice(None), slice(None), 1))]:
        by_position = kind == "k"
        got = activation_patching(model, clean, corrupted, metric, hook=kind, by_position=by_position)
        assert got.shape == ((2, 5, 2) if by_position else (2, 2))

        def patch(a, _name, sl=sl, src=cc[name]):
            a = a.copy()
            a[sl] = src[sl]
            return a

        want = metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, patch)]))
        cell = {"pattern": (1, 1), "q": (0, 0), "k": (1, 3, 1), "v": (1, 1)}[kind]
        assert got[cell] == pytest.approx(want, abs=1e-6)


def test_unbatched_ids_give_the_batched_numbers():
    model = GPT2(GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(1))
    clean, corrupted = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 9, 4, 5])
    metric = logit_diff(7, 8)
    for kind in ("resid_pre", "pattern", "k"):
        for method in ("atp", "atp*"):
            a = attribution_patching(model, clean, corrupted, metric, hook=kind, method=method)
            b = attribution_patching(model, clean[None], corrupted[None], metric, hook=kind, method=method)
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_attribution_patching_rejects_bad_input():
    from attnlab.models import Llama, LlamaConfig
    from attnlab.quant import QuantizedTensor

    model = GPT2(GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(1))
    clean, corrupted = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]])
    metric = logit_diff(7, 8)
    with pytest.raises(ValueError, match=r"same shape \(the same batch and length: the runs are compared position "
                                         r"by position\), got clean \(1, 4\) and corrupted \(1, 5\)"):
        attribution_patching(model, clean, np.array([[1, 5, 3, 4, 4]]), metric)
    with pytest.raises(TypeError, match="attribution_patching needs a metric with a gradient: .* got function "
                                        "without .grad"):
        attribution_patching(model, clean, corrupted, lambda logits: logits[0, -1, 7])
    with pytest.raises(ValueError, match="hook 'rot_q': GPT2 has no hook point blocks.0.attn.hook_rot_q"):
        attribution_patching(model, clean, corrupted, metric, hook="rot_q")
    with pytest.raises(ValueError, match="method must be one of 'atp', 'atp\\*', got 'atp\\+'"):
        attribution_patching(model, clean, corrupted, metric, method="atp+")
    with pytest.raises(ValueError, match="gradient_at must be one of 'clean', 'corrupted'"):
        attribution_patching(model, clean, corrupted, metric, gradient_at="middle")
    with pytest.raises(ValueError, match="is outside the vocabulary of the logits"):
        attribution_patching(model, clean, corrupted, logit_diff(7, 30))
    llama = Llama(LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2), rng=np.random.default_rng(0))
    up = llama.layers[0].mlp.up_proj.weight
    up.data = QuantizedTensor.quantize(up.data, "Q8_0")
    with pytest.raises(TypeError, match="attribution_patching needs gradients, and Llama's blocks.0.mlp.up_proj.weight "
                                        r"is kept quantized \(Q8_0\).*load the model dequantized"):
        attribution_patching(llama, clean, corrupted, metric)


def test_gradient_methods_leave_the_parameters_gradients_alone():
    """The gradient methods' backward passes run with the parameters frozen: the gradients at
    the hook points are the same as with them, and no parameter's .grad is touched."""
    from attnlab.models import Llama, LlamaConfig
    from attnlab.nn._context import frozen_parameters

    model = Llama(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
                  rng=np.random.default_rng(0), dtype=np.float64)
    ids = np.array([[1, 2, 3, 4, 5]])
    G = np.random.default_rng(1).normal(size=(1, 5, 50))
    names = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.attn.hook_q", "blocks.1.hook_q_input"]
    _, full = model.run_with_cache(ids, names_filter=names, incl_bwd=True, grad_out=G)
    before = {n: p.grad.copy() for n, p in model.named_parameters()}
    with frozen_parameters():
        _, frozen = model.run_with_cache(ids, names_filter=names, incl_bwd=True, grad_out=G)
    for n in names:
        np.testing.assert_array_equal(frozen[n + "_grad"], full[n + "_grad"])
    attribution_patching(model, ids, np.array([[1, 2, 9, 4, 5]]), logit_diff(7, 8), hook="z", method="atp*")
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.grad, before[n])


def test_per_head_inputs_with_a_frozen_in_projection():
    """A frozen in-projection (requires_grad=False) on the per-head route (the blocks'
    hook_q_input, ...): the hook points' gradients and every other parameter's gradient are
    the unfrozen run's, and the frozen weight keeps grad None."""
    from attnlab.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2),
                  rng=np.random.default_rng(2), dtype=np.float64)
    ids = np.array([[1, 2, 3, 4, 5]])
    G = np.random.default_rng(3).normal(size=(1, 5, 50))
    names = [f"blocks.{l}.hook_{p}_input" for l in range(2) for p in "qkv"]
    _, full = model.run_with_cache(ids, names_filter=names, incl_bwd=True, grad_out=G)
    want = {n: p.grad.copy() for n, p in model.named_parameters()}
    model.zero_grad()
    frozen = "blocks.1.attn.in_proj_weight"
    dict(model.named_parameters())[frozen].requires_grad_(False)
    _, part = model.run_with_cache(ids, names_filter=names, incl_bwd=True, grad_out=G)
    for n in names:
        np.testing.assert_allclose(part[n + "_grad"], full[n + "_grad"], rtol=1e-12, atol=1e-14)
    for n, p in model.named_parameters():
        if n == frozen:
            assert p.grad is None
        else:
            np.testing.assert_allclose(p.grad, want[n], rtol=1e-12, atol=1e-14, err_msg=n)
