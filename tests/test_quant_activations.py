"""Quantized weights with int8 activations (attnlab.quant.quantize_activations): the rounding
against a NumPy statement of it, every product path and every instruction set's dot products
against ``round_activations(x) @ dequantize(W).T``, the compiled decoding step against the
modules, the bad inputs, and SmolLM2 with its products' inputs rounded."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.core.blockwise import fused_available
from attnlab.quant import (
    KINDS,
    MATVEC_MAX_ROWS,
    QuantizedTensor,
    product_record,
    quantize_activations,
    quantized_linear,
    round_activations,
    stack_rows,
)

F32 = np.float32
SHAPES = [(16, 32), (48, 96), (100, 64), (7, 160), (33, 576)]  # odd and even block counts
ROWS = [1, 3, MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, 40]  # decode (the kernels) and prefill (BLAS)
needs_numba = pytest.mark.skipif(not fused_available(), reason="numba (the fast extra) is not installed")


def rounded(x: np.ndarray) -> np.ndarray:
    """The rounding, stated block by block in float32 (what round_activations must give)."""
    out = np.array(x, dtype=F32, copy=True)
    for row in out.reshape(-1, x.shape[-1]):
        if not np.isfinite(row).all():
            continue
        for b in range(0, row.size, 32):
            d = F32(np.abs(row[b:b + 32]).max()) / F32(127)
            if d < np.finfo(F32).tiny:
                row[b:b + 32] = 0
            else:
                row[b:b + 32] = d * np.rint(row[b:b + 32] * (F32(1) / d))
    return out


def weight(rng, kind: str, shape) -> QuantizedTensor:
    return QuantizedTensor.quantize(rng.standard_normal(shape).astype(F32), kind).with_activations("int8")


def within_round_off(y, xr, w) -> bool:
    """``y`` equals ``xr @ W.T`` (float64) to float32 round-off, which scales with |x||W|."""
    dense = w.dequantize().astype(np.float64)
    ref = xr.astype(np.float64) @ dense.T
    scale = np.abs(xr).astype(np.float64) @ np.abs(dense).T
    return bool(np.all(np.abs(y - ref) <= 2e-6 * scale + 1e-6))


def test_rounding_is_blockwise_int8_with_a_float32_scale():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4, 96)) * rng.uniform(1e-3, 50, (3, 4, 1))).astype(F32)
    x[0, 0, :32] = 0  # a block of zeros stays zeros
    x[0, 1, 32:64] = 1e-39  # d below float32's normal range: the block rounds to 0
    r = round_activations(x)
    assert r.dtype == np.float32 and r.shape == x.shape
    np.testing.assert_array_equal(r, rounded(x))
    assert np.all(r[0, 0, :32] == 0) and np.all(r[0, 1, 32:64] == 0)
    # each block: at most 255 distinct values, d * q with |q| <= 127, the largest kept exactly
    blocks, xb = r.reshape(-1, 32), x.reshape(-1, 32)
    d = np.abs(xb).max(axis=1) / F32(127)
    ok = d >= np.finfo(F32).tiny  # (the 1e-39 block has rounded to 0)
    q = blocks[ok] / d[ok, None]
    assert np.all(np.abs(q - np.rint(q)) < 1e-3) and np.abs(np.rint(q)).max() == 127
    assert np.all(np.abs(blocks[ok] - xb[ok]) <= 0.5 * d[ok, None] * (1 + 1e-5))
    assert not np.array_equal(r, x)


def test_a_row_with_a_nan_or_an_infinity_is_kept_as_it_is():
    x = np.ones((3, 64), F32) * F32(0.3)
    x[1, 40], x[2, 3] = np.inf, np.nan
    r = round_activations(x)
    np.testing.assert_array_equal(r[1:], x[1:])
    np.testing.assert_array_equal(r[0], rounded(x[:1])[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_products_equal_the_rounded_inputs_product(kind, compiled):
    rng = np.random.default_rng(2)
    for shape in SHAPES:
        w = weight(rng, kind, shape)
        bias = rng.standard_normal(shape[0]).astype(F32)
        for n in ROWS:
            x = (rng.standard_normal((n, shape[1])) * rng.uniform(0.05, 20, (n, 1))).astype(F32)
            y = quantized_linear(x, w)
            assert y.shape == (n, shape[0]) and y.dtype == np.float32
            assert within_round_off(y, rounded(x), w), (shape, n)
            # and not the product with x as it is: the rounding is there
            assert not within_round_off(y, x, w), (shape, n)
            yb = quantized_linear(x.reshape(1, n, shape[1]), w, bias)
            np.testing.assert_allclose(yb[0], y + bias, rtol=1e-6, atol=1e-6)


@needs_numba
@pytest.mark.parametrize("isa", ["vnni", "avx2", "scalar"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_every_instruction_sets_dot_products_give_the_same_sums(isa, kind):
    """Each way the 4-bit-by-int8 dot products compile (AVX512-VNNI, AVX2, a scalar loop),
    built here by name; the ones this CPU cannot run are skipped (the features are read
    from numba's own target, never assumed)."""
    from attnlab import _quant_kernels as qk

    have = qk._int8_dot_isa(qk._target_features())
    runs = {"vnni": ("vnni",), "avx2": ("vnni", "avx2"), "scalar": ("vnni", "avx2", "scalar")}[isa]
    if have not in runs:
        pytest.skip(f"this CPU's target ({have}) has no {isa} instructions")
    kernel = qk.q4_matvec_q8 if isa == qk.INT8_DOT_ISA else qk._make_q4_matvec_q8(isa, cache=False)
    rng = np.random.default_rng(3)
    for shape in SHAPES:
        w = weight(rng, kind, shape)
        x = rng.standard_normal((3, shape[1])).astype(F32)
        out = np.full((3, shape[0]), np.nan, F32)
        has_min = kind == "Q4_1"
        kernel(w.codes, w.scales, w.mins if has_min else w.scales, x, out, has_min)
        assert within_round_off(out, rounded(x), w), shape


def test_which_instructions_a_target_gets():
    """The choice reads the target's features (LLVM's list), not the host."""
    from attnlab._quant_kernels import _int8_dot_isa

    assert _int8_dot_isa("+avx2,+avx512f,+avx512vl,+avx512vnni,+avx512bw") == "vnni"
    assert _int8_dot_isa("+avx2,+avx512f,-avx512vl,+avx512vnni") == "avx2"  # VNNI on 256 bits needs VL
    assert _int8_dot_isa("+avx2,-avx512vnni,+fma") == "avx2"
    assert _int8_dot_isa("-avx2,+sse4.2") == "scalar"
    assert _int8_dot_isa("") == "scalar"


@needs_numba
def test_a_kernel_row_with_an_infinity_is_multiplied_as_it_is():
    """A row of x holding an infinity takes the float products (non-finite, as the float
    kernel's); the other rows are still rounded."""
    rng = np.random.default_rng(4)
    w = weight(rng, "Q4_1", (8, 64))
    x = rng.standard_normal((2, 64)).astype(F32)
    x[1, 5] = np.inf
    y = quantized_linear(x, w)
    assert not np.isfinite(y[1]).any()
    assert within_round_off(y[:1], rounded(x[:1]), w)


def test_the_choice_is_carried_by_the_weight_and_its_record():
    rng = np.random.default_rng(5)
    w = QuantizedTensor.quantize(rng.standard_normal((4, 64)).astype(F32), "Q4_1")
    assert w.activations == "float32" and product_record(w)[3] == 2
    w8 = w.with_activations("int8")
    assert w8.codes is w.codes and w8.scales is w.scales and w8.mins is w.mins  # shared, not copied
    assert product_record(w8)[3] == 6 and "activations='int8'" in repr(w8)
    assert product_record(QuantizedTensor.quantize(np.ones((2, 32), F32), "Q8_0").with_activations("int8"))[3] == 4
    assert w8.take_rows(slice(0, 2)).activations == "int8"
    assert stack_rows([w8, w8]).activations == "int8"
    mixed = stack_rows([w8, w])  # not one kind of product: dequantized, as other mixes are
    assert type(mixed) is np.ndarray
    with pytest.raises(ValueError, match="activations"):
        QuantizedTensor.concat_rows([w8, w])
    with pytest.raises(ValueError, match="activations must be one of 'float32', 'int8', got 'int4'"):
        w.with_activations("int4")
    with pytest.raises(AttributeError):
        w.activations = "int8"  # read-only: a new weight is made instead (plans see the parameter replaced)


def test_round_activations_refuses_what_it_cannot_round():
    with pytest.raises(TypeError, match="float64"):
        round_activations(np.ones((2, 32)))
    with pytest.raises(ValueError, match=r"x.*\(2, 33\)"):
        round_activations(np.ones((2, 33), F32))


def tiny_llama(kind="Q4_1", seed=0):
    from attnlab.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Llama(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for name, p in model.named_parameters():
        if p.data.ndim == 2 and name.startswith("blocks."):
            p.data = QuantizedTensor.quantize(rng.normal(0.0, 0.15, p.data.shape).astype(F32), kind)
    return model


def test_quantize_activations_sets_every_quantized_weight_and_refuses_a_float_model():
    model = tiny_llama()
    assert quantize_activations(model) is model
    quantized = [p.data for _, p in model.named_parameters() if isinstance(p.data, QuantizedTensor)]
    assert len(quantized) == 2 * 5 and all(w.activations == "int8" for w in quantized)
    quantize_activations(model, "float32")
    assert all(p.data.activations == "float32" for _, p in model.named_parameters()
               if isinstance(p.data, QuantizedTensor))
    with pytest.raises(ValueError, match="dtype must be one of 'float32', 'int8', got 'int4'"):
        quantize_activations(model, "int4")
    float_model = tiny_llama()
    for _, p in float_model.named_parameters():
        if isinstance(p.data, QuantizedTensor):
            p.data = p.data.dequantize()
    with pytest.raises(ValueError, match="no quantized weights.*quantized=True"):
        quantize_activations(float_model)


@needs_numba
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_compiled_steps_give_the_modules_logits_with_int8_activations(kind, monkeypatch):
    """The compiled decoding step rounds each product's input as the modules' products do:
    logits within float32 round-off of the modules' at every step, and away from the
    float-activation model's by more than that (the rounding is in both)."""
    from attnlab import _decode_kernels

    calls = []
    real = _decode_kernels.decode_layer
    monkeypatch.setattr(_decode_kernels, "decode_layer", lambda *a: (calls.append(1), real(*a))[1])
    model, exact = quantize_activations(tiny_llama(kind)), tiny_llama(kind)
    ids = np.array([[5, 9, 77, 3, 20, 8]])
    fast, slow, ref = model.new_cache(), model.new_cache(), exact.new_cache()
    nxt = model(ids, cache=fast)[:, -1:].argmax(-1)
    model(ids, cache=slow)
    exact(ids, cache=ref)
    moved = 0.0
    for step in range(5):
        got = model(nxt, cache=fast)
        with model.hooks([(f"blocks.{i}.hook_resid_pre", lambda x, name: None) for i in range(2)]):
            want = model(nxt, cache=slow)
        other = exact(nxt, cache=ref)
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max())), step
        moved = max(moved, float(np.abs(got - other).max() / np.abs(other).max()))
        nxt = want[:, -1:].argmax(-1)
    assert len(calls) == 2 * 5 * 2  # every step of both models, every block, compiled
    assert moved > 1e-4, moved


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_gguf):
    from attnlab.models.llama import Llama

    return quantize_activations(Llama.from_pretrained(smollm2_gguf.path, quantized=True))


def test_smollm2_with_int8_activations_stays_close_to_its_float_activations(smollm2_int8, smollm2_model):
    """SmolLM2's products with their inputs rounded to int8: each step's next-token
    distribution within a small KL divergence of the float-activation one (the same file,
    dequantized), and its first answer tokens among that one's likeliest."""
    from test_quant import PROMPTS

    q, f = smollm2_int8, smollm2_model

    def log_softmax(z):
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    kls = []
    for prompt in PROMPTS[:3]:
        ids = q.encode(q.chat_prompt(prompt))[0][None]
        cq, cf = q.new_cache(), f.new_cache()
        lq, lf = q(ids, cache=cq), f(ids, cache=cf)
        nxt = lf[:, -1:].argmax(-1)
        for logits in ((lq, lf), (q(nxt, cache=cq), f(nxt, cache=cf))):
            a, b = log_softmax(logits[1][0, -1]), log_softmax(logits[0][0, -1])
            kls.append(float(np.sum(np.exp(a) * (a - b))))
    print(f"int8 activations: KL from float activations {min(kls):.1e} to {max(kls):.1e} nats a token")
    assert 1e-6 < max(kls) < 0.05, kls
    # near ties may swap (so may llama.cpp's own rounding), but the first answer token stays
    # among the float-activation model's three likeliest
    for prompt in PROMPTS[:6]:
        ids = q.encode(q.chat_prompt(prompt))[0][None]
        top3 = np.argsort(f(ids)[0, -1])[-3:]
        assert q(ids)[0, -1].argmax() in top3, prompt


def test_cli_generate_with_int8_activations(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from attnlab.cli import main
    from gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1")
    args = ["generate", "--checkpoint", str(path), "--raw", "hello", "--max-new-tokens", "4", "--quantized"]
    assert main([*args, "--activations", "int8"]) == 0
    out = capsys.readouterr().out
    assert ("quantized weights with int8 activations" in out) == fused_available()
    assert sum(line.startswith("generated") for line in out.splitlines()) == 1
    assert main(args[:-1] + ["--activations", "int8"]) == 2  # without --quantized
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--activations int8 needs --quantized" in err
    if fused_available():  # a file of float weights: nothing to round the inputs of
        f32 = tmp_path / "f32.gguf"
        write_tiny_gguf(f32, qtype="F32")
        argv = ["generate", "--checkpoint", str(f32), "--raw", "hello", "--quantized", "--activations", "int8"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no Q8_0, Q4_0 or Q4_1 weights" in err
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--activations", "int4"])
    assert exit_.value.code == 2 and "argument --activations: invalid choice: 'int4'" in capsys.readouterr().err
