"""Edge attribution (EAP, EAP-IG), circuits and faithfulness, against a reference written here:
the EAP-IG paper's algorithm (Hanna et al. 2024) with TransformerLens 4.3's hooks
(use_split_qkv_input, use_attn_result, hook_mlp_in) and torch autograd, on random-weight
GPT-2 and grouped-query Llama models written by transformers. Also the blocks' per-head input
hook points against TransformerLens's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

from attnlab.inspect import EdgeGraph, circuit, edge_attribution, faithfulness, logit_diff  # noqa: E402
from attnlab.models import GPT2, GPT2Config, from_pretrained  # noqa: E402
from helpers import random_gpt2, random_llama  # noqa: E402

GOOD, BAD = 5, 9


def _bridge(folder, hf, tokenizer: bool):
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"tokenizer": transformers.AutoTokenizer.from_pretrained(folder)} if tokenizer else {}
        bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, load_weights=True, **kw)
        bridge.enable_compatibility_mode(no_processing=True)
        bridge.set_use_split_qkv_input(True)
        bridge.set_use_attn_result(True)
        bridge.set_use_hook_mlp_in(True)
    return bridge


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        hf = random_gpt2(folder, seed=3, n_layer=2, n_head=3, n_embd=24, vocab_size=40)
    else:
        hf = random_llama(folder, seed=4, vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
    bridge = _bridge(folder, hf, tokenizer=request.param != "gpt2")
    rng = np.random.default_rng(5)
    clean = rng.integers(10, 40, size=(2, 7))
    corrupted = clean.copy()
    corrupted[:, 2] = (corrupted[:, 2] + 3) % 40
    corrupted[1, 4] = 11
    return from_pretrained(folder), bridge, clean, corrupted


def _keeper(kept: dict, name: str):
    """A TransformerLens hook that keeps its tensor's gradient under ``name`` (the MLP's
    input as a copy, so its gradient is the MLP branch's alone, as attnlab's hook_mlp_in)."""
    def keep(x, hook):
        if name.endswith("hook_mlp_in"):
            x = x.clone()
        x.retain_grad()
        kept[name] = x
        return x

    return keep


def _torch_metric(logits):
    return (logits[:, -1, GOOD] - logits[:, -1, BAD]).mean()


def _reference(bridge, clean, corrupted, *, steps: int | None):
    """The paper's scores with TransformerLens hooks and autograd: sources ``hook_embed``,
    ``attn.hook_result`` (per head), ``hook_mlp_out``; targets the split q/k/v inputs, a copy
    of the MLP's input, the last ``hook_resid_post``; ``(clean - corrupted) . mean gradient``
    (the authors' code stores the negative). ``steps=None``: EAP."""
    cfg = bridge.cfg
    N, H = cfg.n_layers, cfg.n_heads
    Hkv = getattr(cfg, "n_key_value_heads", None) or H
    srcs = ["hook_embed"] + [n for l in range(N) for n in (f"blocks.{l}.attn.hook_result", f"blocks.{l}.hook_mlp_out")]

    def outputs(ids):
        with torch.no_grad():
            _, cache = bridge.run_with_cache(torch.from_numpy(ids), names_filter=lambda n: n in srcs)
        out = [cache["hook_embed"].double()]
        for l in range(N):
            out += list(cache[f"blocks.{l}.attn.hook_result"].double().permute(2, 0, 1, 3))
            out.append(cache[f"blocks.{l}.hook_mlp_out"].double())
        return torch.stack(out), cache["hook_embed"]

    a_clean, e_clean = outputs(clean)
    a_corrupted, e_corrupted = outputs(corrupted)

    def gradients(embed):
        kept = {}

        names = [f"blocks.{l}.hook_{p}_input" for l in range(N) for p in "qkv"] + \
            [f"blocks.{l}.hook_mlp_in" for l in range(N)] + [f"blocks.{N - 1}.hook_resid_post"]
        hooks = [(n, _keeper(kept, n)) for n in names]
        if embed is not None:
            hooks.insert(0, ("hook_embed", lambda x, hook: embed.clone().requires_grad_(True)))
        _torch_metric(bridge.run_with_hooks(torch.from_numpy(clean), fwd_hooks=hooks)).backward()
        g = []
        for l in range(N):
            for p, n in (("q", H), ("k", Hkv), ("v", Hkv)):
                g += list(kept[f"blocks.{l}.hook_{p}_input"].grad.double().permute(2, 0, 1, 3)[:n])
            g.append(kept[f"blocks.{l}.hook_mlp_in"].grad.double())
        g.append(kept[f"blocks.{N - 1}.hook_resid_post"].grad.double())
        return torch.stack(g)

    if steps is None:
        grads = gradients(None)
    else:
        grads = sum(gradients(e_corrupted + k / steps * (e_clean - e_corrupted)) for k in range(1, steps + 1)) / steps
    diff = a_clean - a_corrupted
    return torch.einsum("ubte,vbte->uv", diff, grads).numpy()


@pytest.mark.parametrize("method, steps", [("eap", 1), ("eap-ig", 3)])
def test_edge_scores_equal_the_papers_algorithm_in_transformer_lens(pair, method, steps):
    ours, bridge, clean, corrupted = pair
    graph = edge_attribution(ours, clean, corrupted, logit_diff(GOOD, BAD), method=method, steps=steps)
    want = _reference(bridge, clean, corrupted, steps=None if method == "eap" else steps)
    got = graph.scores
    assert got.shape == want.shape
    real = np.isfinite(got)
    err = np.abs(got[real] - want[real]).max() / np.abs(want[real]).max()
    assert err <= 1e-4, err
    # the non-edges: a source after the target (into block l from block l or later, into the
    # MLP of block l from later blocks)
    U, V = got.shape
    assert (~real).sum() == U * V - len(graph)
    assert not real[graph.sources.index("m0"), graph.targets.index("m0")]
    assert real[graph.sources.index("a0.h0"), graph.targets.index("m0")]
    # the mapping reads the same numbers
    (edge, score), *_ = graph.top(1)
    assert graph[edge] == score == np.nanmax(np.abs(got)) * np.sign(score)


def test_eap_ig_with_one_step_at_the_clean_end_is_eap(pair):
    ours, _, clean, corrupted = pair
    metric = logit_diff(GOOD, BAD)
    eap = edge_attribution(ours, clean, corrupted, metric, method="eap")
    ig1 = edge_attribution(ours, clean, corrupted, metric, method="eap-ig", steps=1)
    np.testing.assert_allclose(ig1.scores, eap.scores, rtol=1e-5, atol=1e-6 * np.nanmax(np.abs(eap.scores)))
    # the authors' code's points: k = 0..m-1, so one step is the gradient at the corrupted run
    left = edge_attribution(ours, clean, corrupted, metric, method="eap-ig", steps=1, points="riemann_left")
    assert not np.allclose(left.scores[np.isfinite(left.scores)], eap.scores[np.isfinite(eap.scores)])


def test_per_head_inputs_and_gradients_equal_transformer_lens(pair):
    ours, bridge, clean, _ = pair
    N = len(ours.layers)
    names = [f"blocks.{l}.hook_{p}_input" for l in range(N) for p in "qkv"] + [f"blocks.{l}.hook_mlp_in"
                                                                              for l in range(N)]
    rng = np.random.default_rng(0)
    logits = ours(clean)
    G = rng.normal(size=logits.shape).astype(np.float32)
    out, cache = ours.run_with_cache(clean, names_filter=names, incl_bwd=True, grad_out=G)
    np.testing.assert_allclose(out, logits, atol=1e-5)  # the per-head route gives the same output
    kept = {}
    theirs = bridge.run_with_hooks(torch.from_numpy(clean), fwd_hooks=[(n, _keeper(kept, n)) for n in names])
    (theirs * torch.from_numpy(G)).sum().backward()
    for n in names:
        a, b = kept[n].detach().numpy(), kept[n].grad.numpy()
        assert cache[n].shape == a.shape, n
        np.testing.assert_allclose(cache[n], a, atol=1e-5, err_msg=n)
        np.testing.assert_allclose(cache[n + "_grad"], b, atol=1e-5 * np.abs(b).max(), err_msg=n)


def test_run_with_cache_of_everything_leaves_the_per_head_inputs_off():
    model = GPT2(GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=2),
                 rng=np.random.default_rng(0))
    ids = np.array([[1, 2, 3]])
    _, cache = model.run_with_cache(ids)
    assert "blocks.0.hook_q_input" not in cache and "blocks.0.hook_mlp_in" not in cache
    assert cache["blocks.0.ln1.hook_normalized"].shape == (1, 3, 16)  # not per head
    _, cache = model.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.0"))
    assert "blocks.0.hook_k_input" not in cache
    _, cache = model.run_with_cache(ids, names_filter=["blocks.0.hook_k_input"])
    assert cache["blocks.0.hook_k_input"].shape == (1, 3, 2, 16)


# ----------------------------------------------------------------------------- faithfulness


def test_faithfulness_of_the_whole_graph_and_of_no_edge(pair):
    ours, _, clean, corrupted = pair
    metric = logit_diff(GOOD, BAD)
    graph = edge_attribution(ours, clean, corrupted, metric, method="eap")
    full = faithfulness(ours, graph, clean, corrupted, metric)
    none = faithfulness(ours, [], clean, corrupted, metric)
    assert full.clean == pytest.approx(metric(ours(clean))) and full.corrupted == pytest.approx(metric(ours(corrupted)))
    assert full.share == pytest.approx(1.0, abs=1e-5) and full.edges == len(graph)
    assert none.share == pytest.approx(0.0, abs=1e-5) and none.edges == 0


@pytest.mark.parametrize("batched", [True, False])
def test_faithfulness_in_float64_and_unbatched(batched):
    """The live outputs are copies (a float64 model's MLP output array is then updated in place
    into the residual), and an unbatched pair gives the batched numbers."""
    from attnlab.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2), rng=np.random.default_rng(0),
                  dtype=np.float64)
    clean, corrupted, metric = np.array([1, 2, 3, 4, 5]), np.array([1, 2, 9, 4, 5]), logit_diff(7, 8)
    if batched:
        clean, corrupted = clean[None], corrupted[None]
    graph = edge_attribution(model, clean, corrupted, metric, method="eap")
    assert faithfulness(model, [], clean, corrupted, metric).share == pytest.approx(0.0, abs=1e-9)
    assert faithfulness(model, graph, clean, corrupted, metric).share == pytest.approx(1.0, abs=1e-9)
    half = faithfulness(model, circuit(graph, top_n=20), clean, corrupted, metric)
    other = faithfulness(model, circuit(graph, top_n=20), np.atleast_2d(clean), np.atleast_2d(corrupted), metric)
    assert half.share == pytest.approx(other.share, abs=1e-9)


def test_removing_a_heads_outgoing_edges_is_patching_its_output(pair):
    """The circuit without head a0.h1's outgoing edges runs as the clean model with that head's
    z patched to its corrupted value; without every edge into a1.h0's query, as the clean
    model with that head's queries patched: two runs of activation patching by hooks."""
    ours, _, clean, corrupted = pair
    metric = logit_diff(GOOD, BAD)
    graph = edge_attribution(ours, clean, corrupted, metric, method="eap")
    _, cc = ours.run_with_cache(corrupted, names_filter=["blocks.0.attn.hook_z", "blocks.1.attn.hook_q"])

    def patched(name, head):
        def patch(a, _name):
            a = a.copy()
            a[:, :, head] = cc[name][:, :, head]
            return a
        return metric(ours.run_with_hooks(clean, fwd_hooks=[(name, patch)]))

    without_out = [e for e in graph if e[0] != "a0.h1"]
    got = faithfulness(ours, without_out, clean, corrupted, metric)
    assert got.circuit == pytest.approx(patched("blocks.0.attn.hook_z", 1), abs=1e-4)
    without_in = [e for e in graph if e[1] != "a1.h0<q>"]
    got = faithfulness(ours, without_in, clean, corrupted, metric)
    assert got.circuit == pytest.approx(patched("blocks.1.attn.hook_q", 0), abs=1e-4)
    assert got.share == pytest.approx((got.circuit - got.corrupted) / (got.clean - got.corrupted))


def test_circuit_keeps_the_top_edges_connected(pair):
    ours, _, clean, corrupted = pair
    graph = edge_attribution(ours, clean, corrupted, logit_diff(GOOD, BAD), method="eap")
    top = circuit(graph, top_n=12, prune=False)
    assert len(top) == 12
    biggest = sorted(np.abs(graph.scores[np.isfinite(graph.scores)]))[-12:]
    np.testing.assert_allclose(sorted(abs(top[e]) for e in top), biggest)
    pruned = circuit(graph, top_n=12)
    assert set(pruned) <= set(top)
    # every kept edge starts at the input or at a component that an edge of the circuit
    # feeds, and ends at the logits or at a component with a kept edge out
    kept = set(pruned)
    fed = {"input"} | {t.partition("<")[0] for _, t in kept}
    feeds = {"logits"} | {s for s, _ in kept}
    for s, t in kept:
        assert s in fed or s.startswith("a") and any(x.startswith(s.split(".")[0] + ".kv") for x in fed)
        assert t == "logits" or t.partition("<")[0] in feeds or ".kv" in t
    assert len(circuit(graph, top_n=0)) == 0


# ----------------------------------------------------------------------------- bad input


def test_edge_attribution_rejects_bad_input():
    model = GPT2(GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(0))
    clean, corrupted = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]])
    metric = logit_diff(7, 8)
    with pytest.raises(ValueError, match=r"clean \(1, 4\) and corrupted \(1, 3\)"):
        edge_attribution(model, clean, corrupted[:, :3], metric)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        edge_attribution(model, clean, corrupted, metric, steps=0)
    with pytest.raises(TypeError, match="edge_attribution needs a metric with a gradient.*got function without "
                                        ".grad"):
        edge_attribution(model, clean, corrupted, lambda logits: float(logits[0, -1, 7]))
    with pytest.raises(ValueError, match="points must be one of 'riemann_right', 'riemann_left'"):
        edge_attribution(model, clean, corrupted, metric, points="gausslegendre")
    graph = edge_attribution(model, clean, corrupted, metric, method="eap")
    assert isinstance(graph, EdgeGraph)
    with pytest.raises(KeyError, match="there is no edge a1.h0 -> a0.h1<q>"):
        graph["a1.h0", "a0.h1<q>"]
    with pytest.raises(KeyError, match="'a7.h0' is not a source node"):
        faithfulness(model, [("a7.h0", "logits")], clean, corrupted, metric)
    with pytest.raises(ValueError, match="top_n must be an int >= 0"):
        circuit(graph, top_n=-1)


def test_edge_attribution_refuses_sandwich_norms_and_quantized_weights():
    from attnlab.models import Gemma, GemmaConfig, Llama, LlamaConfig
    from attnlab.quant import QuantizedTensor

    gemma = Gemma(GemmaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8),
                  rng=np.random.default_rng(0))
    ids = np.array([[1, 2, 3]])
    with pytest.raises(TypeError, match="block 0 is sandwich-normed"):
        edge_attribution(gemma, ids, ids, logit_diff(1, 2))
    llama = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2), rng=np.random.default_rng(0))
    up = llama.layers[0].mlp.up_proj.weight
    up.data = QuantizedTensor.quantize(up.data, "Q8_0")
    with pytest.raises(TypeError, match=r"edge_attribution needs gradients, and Llama's blocks.0.mlp.up_proj.weight "
                                        r"is kept quantized \(Q8_0\).*load the model dequantized"):
        edge_attribution(llama, ids, ids, logit_diff(1, 2))
