"""Gradients at the hook points and hooks per call: forward hooks that ablate a head (torch's
gradient with the same hook), backward hooks that read or replace a gradient, hooks and
tapes of two threads running one model, a module called twice in one forward pass, and
every bad input of backward."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

from attnlab.models import GPT2, GPT2Config, from_pretrained
from attnlab.models.llama import Llama, LlamaConfig
from attnlab.nn import Linear, ReLU, Sequential
from helpers import TOL, grad_rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_oracle import V, batch, hf_decoder, parameter_grads, patch_eager, torch_backward  # noqa: E402


@pytest.fixture
def eager(monkeypatch):
    return patch_eager(monkeypatch)


def _gpt2(seed=0, dtype=np.float32):
    cfg = GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    return GPT2(cfg, rng=np.random.default_rng(seed), dtype=dtype)


@pytest.fixture(scope="module")
def gqa3(tmp_path_factory):
    """A transformers Llama with grouped-query heads (6 over 2) and its saved folder."""
    hf = hf_decoder("llama-gqa3-bias-yarn", 11)
    folder = tmp_path_factory.mktemp("gqa3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(folder)
    return hf, folder


def _float64_pair(gqa3, eager, *, seed: int, T: int):
    """``(transformers model, attnlab model, ids, mask, grad of the logits)``: both float64
    (transformers' without its float32 casts), attnlab's in training mode, a left-padded batch
    whose padded positions' logits get no gradient."""
    hf, folder = gqa3
    eager.float64()
    ours = from_pretrained(folder, dtype=np.float64).train()
    rng = np.random.default_rng(seed)
    ids, mask = batch(rng, T=T)
    g = (rng.standard_normal((*ids.shape, V)) * mask[..., None]).astype(np.float64)
    return hf.double(), ours, ids, mask, g


def _torch_grads(hf, ids, mask, g, hooks):
    """transformers' parameter gradients of ``sum(logits * g)`` with ``hooks(hf)`` (a list of
    handles) registered for the call."""
    return torch_backward(hf, ids, mask, g, hooks(hf))


def _compare_parameters(ours, hf, tol):
    for name, (got, want) in parameter_grads(ours, hf).items():
        err = grad_rel_err(got, want)
        assert err <= tol, (name, err)


@pytest.mark.parametrize("in_place", [False, True], ids=["returns a copy", "writes in place"])
def test_a_forward_hook_that_zero_ablates_a_head_has_torchs_gradient(in_place, gqa3, eager):
    """A forward hook on blocks.0.attn.hook_z that zeroes head 2 (returning a zeroed copy, or
    writing into the activation and returning None): every parameter's gradient and hook_z's
    equal torch's with the same hook (a forward pre-hook on o_proj), float64; the head's
    query rows get no gradient."""
    hf, ours, ids, mask, g = _float64_pair(gqa3, eager, seed=8, T=9)
    H, D = ours.config.num_attention_heads, ours.config.head_size
    head = 2

    def ablate(z, name):
        if in_place:
            z[:, :, head] = 0.0
            return None
        z = z.copy()
        z[:, :, head] = 0.0
        return z

    seen = {}
    logits = ours.run_with_hooks(ids, mask, fwd_hooks=[("blocks.0.attn.hook_z", ablate)],
                                 bwd_hooks=[("blocks.0.attn.hook_z", lambda gz, n: seen.setdefault(n, gz.copy()))])
    ours.backward(g)
    kept = {}

    def pre(module, args):
        x = args[0].clone()
        B, T, _ = x.shape
        x.view(B, T, H, D)[:, :, head] = 0.0
        x.retain_grad()
        kept["z"] = x
        return (x,)

    want = _torch_grads(hf, ids, mask, g, lambda m: [m.model.layers[0].self_attn.o_proj.register_forward_pre_hook(pre)])
    real = mask.astype(bool)
    assert np.abs(logits - want)[real].max() <= 1e-9 * np.abs(want).max()
    _compare_parameters(ours, hf, TOL[np.float64])
    gz = seen["blocks.0.attn.hook_z"]
    assert grad_rel_err(gz, kept["z"].grad.numpy().reshape(gz.shape)) <= TOL[np.float64]
    wq = ours.layers[0].attn.in_proj_weight.grad[head * D:(head + 1) * D]
    assert not wq.any()  # the ablated head's queries reach nothing
    assert ours.layers[0].attn.in_proj_weight.grad[:D].any()


def test_a_backward_hook_that_replaces_a_gradient_has_torchs_effect(gqa3, eager):
    """A backward hook on blocks.0.hook_resid_post that halves the gradient: every parameter
    before it (block 0, the embedding) gets torch's gradient with a tensor hook doing the
    same; a reading hook on hook_embed sees dL/d(embeddings)."""
    hf, ours, ids, mask, g = _float64_pair(gqa3, eager, seed=9, T=8)
    seen = {}
    with ours.hooks(bwd_hooks=[("blocks.0.hook_resid_post", lambda gr, n: gr * 0.5),
                               ("hook_embed", lambda gr, n: seen.setdefault(n, gr.copy()))]):
        ours(ids, mask)
        ours.backward(g)
    kept = {}

    def layer0(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h.register_hook(lambda gr: gr * 0.5)

    def embed(module, args, out):
        out.retain_grad()
        kept["embed"] = out

    _torch_grads(hf, ids, mask, g, lambda m: [m.model.layers[0].register_forward_hook(layer0),
                                              m.model.embed_tokens.register_forward_hook(embed)])
    _compare_parameters(ours, hf, TOL[np.float64])
    assert grad_rel_err(seen["hook_embed"], kept["embed"].grad.numpy()) <= TOL[np.float64]


# ---- hooks and tapes per thread -----------------------------------------------------------------
def _ablate(head):
    def fn(z, name):
        z = z.copy()
        z[:, :, head] = 0.0
        return z

    return fn


SETTINGS = {
    "block 0 head 1": [("blocks.0.attn.hook_z", _ablate(1))],
    "block 1 head 3": [("blocks.1.attn.hook_z", _ablate(3))],
    "no hooks": [],
}


def test_two_threads_with_different_hooks_get_their_own_results():
    """2 threads x 3 hook settings (two head ablations and none), 20 calls each, through
    run_with_hooks and through ``with model.hooks(...)``: every result equals the
    single-threaded run of its setting (the settings' results differ from each other)."""
    model = _gpt2(seed=3).eval()
    ids = np.random.default_rng(0).integers(0, V, (2, 12))
    want = {k: model.run_with_hooks(ids, fwd_hooks=hooks) for k, hooks in SETTINGS.items()}
    keys = list(SETTINGS)
    for a in keys:
        for b in keys:
            if a != b:
                assert np.abs(want[a] - want[b]).max() > 1e-3
    wrong, barrier = [], threading.Barrier(2)

    def work(phase: int):
        barrier.wait()
        for n in range(20):
            key = keys[(n + phase) % 3]
            if n % 2:
                got = model.run_with_hooks(ids, fwd_hooks=SETTINGS[key])
            else:
                with model.hooks(SETTINGS[key]):
                    got = model(ids)
            if not np.allclose(got, want[key], rtol=1e-5, atol=1e-5):
                wrong.append((phase, n, key))

    threads = [threading.Thread(target=work, args=(p,)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_hooks_attached_in_one_thread_do_not_reach_another():
    model = _gpt2(seed=4).eval()
    ids = np.array([[1, 2, 3, 4]])
    clean = model(ids)
    got = {}
    with model.hooks(SETTINGS["block 0 head 1"]):
        t = threading.Thread(target=lambda: got.setdefault("other", model(ids)))
        t.start()
        t.join()
        got["here"] = model(ids)
    np.testing.assert_array_equal(got["other"], clean)
    assert not np.allclose(got["here"], clean)


def test_two_threads_train_one_model_on_their_own_tapes():
    """Two threads each run a forward pass and its backward (overlapping) on one model in
    training mode: the parameters' gradients are the sum of both, and each thread's
    hook_embed gradient is its own."""
    model = _gpt2(seed=5, dtype=np.float64).train()
    rng = np.random.default_rng(1)
    inputs = [rng.integers(0, V, (2, 10)) for _ in range(2)]
    grads = [rng.standard_normal((2, 10, V)) for _ in range(2)]
    alone = []
    for x, g in zip(inputs, grads, strict=True):
        model.zero_grad()
        _, cache = model.run_with_cache(x, names_filter="hook_embed", incl_bwd=True, grad_out=g)
        alone.append((cache["hook_embed_grad"], {n: p.grad.copy() for n, p in model.named_parameters()}))
    model.zero_grad()
    got, barrier = {}, threading.Barrier(2)

    def work(i):
        seen = {}
        with model.hooks(bwd_hooks=[("hook_embed", lambda gr, n: seen.setdefault(n, gr.copy()))]):
            model(inputs[i])
            barrier.wait()  # both forward passes done before either backward
            model.backward(grads[i])
        got[i] = seen["hook_embed"]

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        np.testing.assert_allclose(got[i], alone[i][0], rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, alone[0][1][name] + alone[1][1][name], rtol=1e-10, atol=1e-12)


def test_a_module_called_twice_in_one_forward_pass_gets_both_gradients():
    """One Linear used twice in a Sequential: its two calls keep two entries on the tape,
    and its gradient is the sum of both uses (torch autograd with a shared nn.Linear)."""
    rng = np.random.default_rng(2)
    lin = Linear(5, 5, rng=rng, dtype=np.float64)
    net = Sequential(lin, ReLU(), lin)
    x = rng.standard_normal((3, 5))
    g = rng.standard_normal((3, 5))
    net(x)
    gx = net.backward(g)
    t = torch.nn.Linear(5, 5).double()
    with torch.no_grad():
        t.weight.copy_(torch.from_numpy(lin.weight.data))
        t.bias.copy_(torch.from_numpy(lin.bias.data))
    tx = torch.tensor(x, requires_grad=True)
    (t(torch.relu(t(tx))) * torch.from_numpy(g)).sum().backward()
    np.testing.assert_allclose(lin.weight.grad, t.weight.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(lin.bias.grad, t.bias.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-12)


# ---- bad input ------------------------------------------------------------------------------------
def test_backward_before_a_forward_or_after_an_eval_forward_says_to_train():
    model = _gpt2().train()
    g = np.zeros((1, 3, V), np.float32)
    with pytest.raises(RuntimeError, match=r"GPT2.backward\(\) needs a forward call in training mode first: "
                                           r"call .train\(\) before the forward pass"):
        model.backward(g)
    model.eval()
    model(np.array([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match=r"call .train\(\) before the forward pass \(eval mode, the default"):
        model.backward(g)
    model.train()  # train() after the eval forward pass: still nothing kept
    with pytest.raises(RuntimeError, match="needs a forward call in training mode"):
        model.backward(g)


def test_one_backward_per_forward():
    model = _gpt2().train()
    logits = model(np.array([[1, 2, 3]]))
    model.backward(np.ones_like(logits))
    with pytest.raises(RuntimeError, match=r"GPT2.backward\(\) already ran for the last forward pass, which freed "
                                           r"what that pass kept: run the forward pass again"):
        model.backward(np.ones_like(logits))
    model(np.array([[1, 2, 3]]))
    model.backward(np.ones_like(logits))  # a new forward pass: a new backward


def test_grad_out_of_the_wrong_shape_or_dtype_is_named_and_frees_nothing():
    model = _gpt2().train()
    logits = model(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"grad_out has shape \(1, 2, 61\), but should be \(1, 3, 61\)"):
        model.backward(np.ones((1, 2, V), np.float32))
    with pytest.raises(TypeError, match=r"grad_out has dtype float64, but should be float32"):
        model.backward(np.ones((1, 3, V)))
    model.backward(np.ones_like(logits))  # the checks freed nothing
    assert model.tok_emb.weight.grad is not None


def test_backward_through_quantized_weights_says_to_load_dequantized():
    from attnlab.quant import QuantizedTensor

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Llama(cfg, rng=np.random.default_rng(0))
    up = model.layers[0].mlp.up_proj.weight
    up.data = QuantizedTensor.quantize(up.data, "Q8_0")
    model.train()
    logits = model(np.array([[1, 2, 3]]))
    with pytest.raises(TypeError, match=r"blocks.0.mlp.up_proj.weight is kept quantized \(Q8_0\).*load the model "
                                        r"dequantized \(load_smollm2\(\) or from_pretrained\(path\) without "
                                        r"quantized=True"):
        model.backward(np.ones_like(logits))


def test_a_backward_hook_of_the_wrong_shape_is_named():
    model = _gpt2().train()
    with model.hooks(bwd_hooks=[("blocks.0.hook_resid_post", lambda g, n: g[..., :-1])]):
        logits = model(np.array([[1, 2, 3]]))
        with pytest.raises(ValueError, match=r"the backward hook on 'blocks.0.hook_resid_post' returned an array "
                                             r"\(1, 3, 31\) of dtype float32, but the gradient is \(1, 3, 32\)"):
            model.backward(np.ones_like(logits))
    with model.hooks(bwd_hooks=[("hook_embed", lambda g, n: g.astype(np.float64))]):
        logits = model(np.array([[1, 2, 3]]))
        with pytest.raises(ValueError, match=r"backward hook on 'hook_embed' returned .* of dtype float64"):
            model.backward(np.ones_like(logits))


def test_incl_bwd_needs_grad_out_and_grad_out_needs_incl_bwd():
    model = _gpt2()
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="incl_bwd=True needs grad_out"):
        model.run_with_cache(ids, incl_bwd=True)
    with pytest.raises(ValueError, match="grad_out is read only with incl_bwd=True"):
        model.run_with_cache(ids, grad_out=np.ones((1, 3, V), np.float32))


def test_backward_hooks_attached_around_backward_alone_are_refused():
    model = _gpt2().train()
    logits = model(np.array([[1, 2, 3]]))
    with model.hooks(bwd_hooks=[("hook_embed", lambda g, n: None)]):
        with pytest.raises(ValueError, match=r"backward hooks on hook_embed are attached around backward\(\) but "
                                             r"were not around the forward pass"):
            model.backward(np.ones_like(logits))


def test_no_backward_through_a_cached_forward():
    model = _gpt2().train()
    logits = model(np.array([[1, 2, 3]]), cache=model.new_cache())
    with pytest.raises(RuntimeError, match="no backward pass through a call with a key/value cache"):
        model.backward(np.ones_like(logits))


# ---- run_with_cache(incl_bwd=True) ------------------------------------------------------------------
def test_run_with_cache_incl_bwd_in_eval_mode_caches_gradients_as_transformer_lens_names_them():
    """In eval mode (the default after loading) incl_bwd keeps what its own backward needs:
    the cache holds the activations, then ``name + "_grad"`` in forward order; the gradients
    equal a training-mode backward's with a reading backward hook, and the model keeps
    nothing after the call."""
    model = _gpt2(seed=6, dtype=np.float64).eval()
    ids = np.array([[3, 1, 4, 1, 5]])
    g = np.random.default_rng(0).standard_normal((1, 5, V))
    names = ["hook_embed", "blocks.0.attn.hook_pattern", "blocks.1.hook_resid_post"]
    logits, cache = model.run_with_cache(ids, names_filter=names, incl_bwd=True, grad_out=g)
    assert list(cache) == names + [n + "_grad" for n in names]
    assert cache["blocks.0.attn.hook_pattern_grad"].shape == (1, 4, 5, 5)
    seen = {}
    model.train()
    with model.hooks(bwd_hooks=[(n, lambda gr, name: seen.setdefault(name, gr.copy())) for n in names]):
        np.testing.assert_array_equal(model(ids), logits)
        model.backward(g)
    for n in names:
        np.testing.assert_allclose(cache[n + "_grad"], seen[n], rtol=1e-12, atol=1e-14)
    model.eval()
    with pytest.raises(RuntimeError, match="needs a forward call in training mode"):
        model.backward(g)


def test_a_large_embedding_table_adds_its_rows_into_the_gradient_in_place():
    """A table too large for the one-hot product (V * N > 2^22) adds the looked-up rows'
    gradients into ``.grad`` where they are: a row looked up twice gets both, and a gradient
    already there (a tied output layer's) is added to, not replaced."""
    from attnlab.nn import Embedding

    rng = np.random.default_rng(3)
    emb = Embedding(70_000, 3, rng=rng, dtype=np.float64)
    ids = rng.integers(0, 70_000, (2, 32))
    ids[1, 5] = ids[0, 0]  # one row twice
    g = rng.standard_normal((2, 32, 3))
    before = rng.standard_normal((70_000, 3))
    emb.weight.grad = before.copy()
    emb(ids)
    emb.backward(g)
    want = before.copy()
    np.add.at(want, ids.reshape(-1), g.reshape(-1, 3))
    np.testing.assert_allclose(emb.weight.grad, want, rtol=1e-13)


def test_a_tape_does_not_keep_a_dropped_model_alive():
    """What a forward pass kept is the thread's, keyed weakly by the modules: a model trained
    and dropped is freed, with what its last forward pass kept."""
    import gc
    import weakref

    model = _gpt2().train()
    model(np.array([[1, 2, 3]]))  # kept for a backward that never comes
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_logits_to_keep_and_an_unbatched_sequence_backpropagate_like_the_full_batch():
    """backward after ``logits_to_keep=2`` equals the full pass's with the other positions'
    gradient zero; an unbatched sequence ``(T,)`` (logits ``(T, V)``) equals a batch of one."""
    model = _gpt2(seed=7, dtype=np.float64).train()
    ids = np.array([[4, 8, 15, 16, 23, 42]])
    g = np.random.default_rng(0).standard_normal((1, 6, V))
    g[:, :4] = 0.0

    def grads(run):
        model.zero_grad()
        run()
        return {n: p.grad.copy() for n, p in model.named_parameters()}

    full = grads(lambda: (model(ids), model.backward(g)))
    kept = grads(lambda: (model(ids, logits_to_keep=2), model.backward(g[:, 4:])))
    one = grads(lambda: (model(ids[0]), model.backward(g[0])))
    for name in full:
        np.testing.assert_allclose(kept[name], full[name], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(one[name], full[name], rtol=1e-12, atol=1e-14)
    assert np.abs(full["blocks.0.attn.in_proj_weight"]).max() > 0
