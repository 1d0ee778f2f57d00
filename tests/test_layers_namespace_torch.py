"""Layers on torch tensors (``Module.to(torch)``): they compute in torch through the core's
namespace path and return torch tensors of the weights' dtype, equal to the NumPy path and
to torch's own modules; ``to(np)`` brings the weights back unchanged; backward says it is
NumPy-only."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.interop import to_torch
from attnlab.nn import (
    GELU,
    Embedding,
    KVCache,
    LayerNorm,
    Linear,
    MultiheadAttention,
    ReLU,
    SelfAttention,
    TransformerBlock,
)
from helpers import LAYER_CASES, normal, perturbed, rel_err, run_case

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

TOL = {"float32": 1e-5, "float64": 1e-12}  # max abs error relative to the reference's largest entry
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    yield
    print("\nworst relative error on torch:", {k: f"{v:.2g}" for k, v in sorted(WORST.items())})


def close(got, want: np.ndarray, dtype: str, what: str = "") -> None:
    """``got`` is a CPU torch tensor of ``dtype`` equal to ``want`` within the dtype's tolerance."""
    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == getattr(torch, dtype) and got.device.type == "cpu"
    err = rel_err(got.detach().numpy(), np.asarray(want))
    WORST[f"{dtype} {what}".strip()] = max(WORST.get(f"{dtype} {what}".strip(), 0.0), err)
    assert err <= TOL[dtype], (what, err)


def t(a: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_on_torch_equals_numpy_path(case, dtype):
    want = run_case(case, dtype)
    got = run_case(case, dtype, t, convert=lambda layer: layer.to(torch))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            close(g, w, dtype, "vs NumPy path")


# ---- against torch's own modules ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_linear_layernorm_activations_embedding_equal_torchs(dtype):
    F = torch.nn.functional
    x = normal((2, 5, 8), dtype)
    lin = perturbed(Linear(8, 5, rng=np.random.default_rng(0), dtype=dtype))
    ref = to_torch(lin)
    close(lin.to(torch)(t(x)), ref(t(x)).detach().numpy(), dtype, "vs torch")
    ln = perturbed(LayerNorm(8, eps=1e-6, dtype=dtype)).to(torch)
    close(ln(t(x)), F.layer_norm(t(x), (8,), ln.weight.data, ln.bias.data, 1e-6).numpy(), dtype, "vs torch")
    z = normal((3, 400), dtype) * 4
    close(GELU()(t(z)), F.gelu(t(z)).numpy(), dtype, "vs torch")
    close(GELU("tanh")(t(z)), F.gelu(t(z), approximate="tanh").numpy(), dtype, "vs torch")
    close(ReLU()(t(z)), F.relu(t(z)).numpy(), dtype, "vs torch")
    emb = perturbed(Embedding(11, 8, rng=np.random.default_rng(0), dtype=dtype)).to(torch)
    ids = np.random.default_rng(1).integers(0, 11, size=(2, 5))
    close(emb(t(ids)), F.embedding(t(ids), emb.weight.data).numpy(), dtype, "vs torch")
    close(emb(ids), F.embedding(t(ids), emb.weight.data).numpy(), dtype, "vs torch")  # NumPy ids move over


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_self_attention_equals_torch(dtype):
    layer = perturbed(SelfAttention(8, 6, rng=np.random.default_rng(0), dtype=dtype))
    ref = to_torch(layer)
    x = normal((2, 5, 8), dtype)
    context, weights = layer.to(torch)(t(x))
    want_c, want_w = ref(t(x))
    close(context, want_c.detach().numpy(), dtype, "vs torch")
    close(weights, want_w.detach().numpy(), dtype, "vs torch")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("options", [{}, {"add_bias_kv": True, "add_zero_attn": True}, {"kdim": 6, "vdim": 4}])
@pytest.mark.parametrize("average", [True, False])
def test_multihead_attention_equals_torch(dtype, options, average):
    mha = perturbed(MultiheadAttention(8, 2, rng=np.random.default_rng(0), dtype=dtype, **options))
    ref = to_torch(mha).train()  # dropout is 0; training mode keeps torch off its fused fast path
    q, k, v = normal((5, 2, 8), dtype), normal((7, 2, mha.kdim), dtype, 1), normal((7, 2, mha.vdim), dtype, 2)
    keep = np.random.default_rng(3).random((2, 7)) < 0.6
    keep[:, 0] = True
    bias = normal((5, 7), dtype, 4)
    out, w = mha.to(torch)(t(q), t(k), t(v), key_padding_mask=t(keep), attn_mask=t(bias), average_attn_weights=average)
    padding = t(np.where(keep, 0.0, -np.inf).astype(dtype))  # torch wants one mask kind for both
    want, want_w = ref(t(q), t(k), t(v), key_padding_mask=padding, attn_mask=t(bias), average_attn_weights=average)
    close(out, want.detach().numpy(), dtype, "vs torch")
    close(w, want_w.detach().numpy(), dtype, "vs torch")


def torch_encoder_layer(block: TransformerBlock, activation: str):
    """torch's TransformerEncoderLayer with ``block``'s weights (the same pre/post-norm layout)."""
    attn = block.attn
    ref = torch.nn.TransformerEncoderLayer(
        attn.embed_dim, attn.num_heads, block.mlp[0].out_features, dropout=0.0, activation=activation,
        layer_norm_eps=block.ln_1.eps, batch_first=True, norm_first=block.norm_first,
        dtype=getattr(torch, attn.dtype.name),
    )
    names = {"attn.": "self_attn.", "mlp.0.": "linear1.", "mlp.2.": "linear2.", "ln_1.": "norm1.", "ln_2.": "norm2."}
    state = {}
    for name, arr in block.state_dict().items():
        prefix = next(p for p in names if name.startswith(p))
        state[names[prefix] + name[len(prefix):]] = t(arr)
    ref.load_state_dict(state)
    return ref.train()  # dropout is 0; training mode keeps torch off its fused fast path


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("norm_first,causal,activation", [(True, True, "gelu"), (False, False, "relu")])
def test_transformer_block_equals_torch_encoder_layer(dtype, norm_first, causal, activation):
    block = perturbed(TransformerBlock(8, 2, 12, causal=causal, norm_first=norm_first, activation=activation,
                                       rng=np.random.default_rng(0), dtype=dtype))
    ref = torch_encoder_layer(block, activation)
    x = normal((2, 5, 8), dtype)
    keep = np.ones((2, 5), dtype=bool)
    keep[1, 3:] = False
    block.to(torch)
    if causal:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=getattr(torch, dtype))
        close(block(t(x)), ref(t(x), src_mask=mask, is_causal=True).detach().numpy(), dtype, "vs torch")
    else:
        got = block(t(x), key_padding_mask=t(keep))
        close(got, ref(t(x), src_key_padding_mask=t(~keep)).detach().numpy(), dtype, "vs torch")


# ---- the rest of the path ------------------------------------------------------------------


def test_kv_cache_on_torch_decodes_as_the_whole_sequence():
    block = perturbed(TransformerBlock(8, 2, 12, rng=np.random.default_rng(0))).eval().to(torch)
    x = t(normal((2, 6, 8), "float32"))
    cache = KVCache()
    steps = [block(x[:, :4], cache=cache), block(x[:, 4:5], cache=cache), block(x[:, 5:], cache=cache)]
    assert len(cache) == 6
    close(torch.cat(steps, dim=1), block(x).numpy(), "float32", "KV cache")


def test_tiny_transformer_on_torch_gives_the_numpy_logits():
    from attnlab.models import TinyTransformer, TinyTransformerConfig

    cfg = TinyTransformerConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2, d_ff=24, activation="gelu")
    model = perturbed(TinyTransformer(cfg, rng=np.random.default_rng(0))).eval()
    ids = np.random.default_rng(2).integers(0, 11, size=(3, 8))
    want = model(ids)
    close(model.to(torch)(ids), want, "float32", "TinyTransformer")


def test_dropout_in_training_draws_numpys_mask():
    """A layer in training mode draws its dropout masks on the host: the same as NumPy for the same seed."""
    x = normal((2, 5, 8), "float64")
    layers = [
        MultiheadAttention(8, 2, dropout=0.3, batch_first=True, rng=np.random.default_rng(4), dtype=np.float64)
        for _ in range(2)
    ]
    want = layers[0](x, x, x)
    got = layers[1].to(torch)(t(x), t(x), t(x))
    for g, w in zip(got, want, strict=True):
        close(g, w, "float64", "dropout")


def test_to_and_back_keeps_weights_and_state_dict_stays_numpy():
    block = perturbed(TransformerBlock(8, 2, 12, rng=np.random.default_rng(0), dtype=np.float64))
    before = block.state_dict()
    block.to(torch)
    assert all(isinstance(p.data, torch.Tensor) and p.data.dtype == torch.float64 for p in block.parameters())
    state = block.state_dict()
    assert all(type(a) is np.ndarray for a in state.values())
    for name, arr in before.items():
        np.testing.assert_array_equal(state[name], arr)
    block.load_state_dict({k: v * 2 for k, v in before.items()})  # loads into the torch weights
    assert isinstance(block.ln_1.weight.data, torch.Tensor)
    block.to(np)
    assert all(type(p.data) is np.ndarray for p in block.parameters())
    for name, arr in block.state_dict().items():
        np.testing.assert_array_equal(arr, before[name] * 2)


def test_to_targets_an_array_a_device_and_keeps_the_library_for_a_device():
    layer = Linear(3, 2, rng=np.random.default_rng(0), dtype=np.float64)
    assert layer.to(torch.zeros(1)) is layer and isinstance(layer.weight.data, torch.Tensor)
    layer.to("cpu")
    assert isinstance(layer.weight.data, torch.Tensor) and layer.weight.data.device.type == "cpu"
    assert torch.equal(to_torch(layer).weight.detach(), layer.weight.data)  # exports from any library
    layer.to(np.zeros(1))
    assert type(layer.weight.data) is np.ndarray
    layer.to("cpu")  # NumPy on the host: nothing to do
    assert type(layer.weight.data) is np.ndarray


def test_moving_drops_gradients():
    layer = Linear(3, 2, rng=np.random.default_rng(0))
    layer(np.ones((1, 3), np.float32))
    layer.backward(np.ones((1, 2), np.float32))
    assert layer.weight.grad is not None
    layer.to(np)  # nothing moves: the gradients stay
    assert layer.weight.grad is not None
    layer.to(torch)
    assert layer.weight.grad is None


# ---- errors --------------------------------------------------------------------------------


def test_backward_after_a_torch_forward_says_it_is_numpy_only():
    block = TransformerBlock(8, 2, 12, rng=np.random.default_rng(0)).to(torch)
    block(t(normal((1, 3, 8), "float32")))
    with pytest.raises(TypeError, match=r"backward\(\) runs on NumPy arrays only, but its forward pass ran on "
                                        r"torch\.Tensor: call \.to\(np\)"):
        block.backward(np.ones((1, 3, 8), np.float32))
    gelu = GELU()  # no weights: the cache itself tells
    gelu(t(normal((3,), "float32")))
    with pytest.raises(TypeError, match="GELU.backward.* ran on torch.Tensor"):
        gelu.backward(np.ones(3, np.float32))


def test_inputs_of_another_library_are_refused_by_name():
    layer = Linear(3, 2, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"x is torch\.Tensor, but the layer's weights are NumPy arrays.*layer\.to"):
        layer(torch.ones(1, 3))
    layer.to(torch)
    with pytest.raises(TypeError, match=r"x is numpy\.ndarray, but the layer's weights are torch\.Tensor on cpu"):
        layer(np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64, but the layer's parameters are torch\.float32"):
        layer(torch.ones(1, 3, dtype=torch.float64))
    mha = MultiheadAttention(4, 2, batch_first=True, rng=np.random.default_rng(0)).to(torch)
    q = torch.ones(1, 3, 4)
    with pytest.raises(TypeError, match=r"query is torch\.Tensor, key_padding_mask is numpy\.ndarray"):
        mha(q, q, q, key_padding_mask=np.ones((1, 3), bool))
    with pytest.raises(TypeError, match=r"ids is torch\.Tensor, but the layer's weights are NumPy arrays"):
        Embedding(4, 2, rng=np.random.default_rng(0))(torch.tensor([1]))


def test_bad_targets_are_refused():
    import math

    layer = Linear(3, 2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"NumPy arrays live on the host, not on device 'cuda'.*layer\.to\(torch, "
                                         r"device='cuda'\)"):
        layer.to("cuda")
    with pytest.raises(ValueError, match="not on device 'cuda'"):
        layer.to(np, device="cuda")
    with pytest.raises(TypeError, match="math is not an array library"):
        layer.to(math)
    with pytest.raises(TypeError, match="pass one device"):
        layer.to("cpu", device="cpu")
    assert type(layer.weight.data) is np.ndarray  # nothing moved


def test_a_layer_without_weights_moves_nowhere_and_layernorm_without_weights_moves():
    assert GELU().to("cuda").approximate == "none"  # nothing to move, even to a device NumPy lacks
    ln = LayerNorm(4, elementwise_affine=False, dtype=np.float64).to(torch)
    y = ln.to("cpu")(torch.ones(2, 4, dtype=torch.float64))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float64
    with pytest.raises(TypeError, match=r"x is numpy\.ndarray, but the layer's weights are torch\.Tensor"):
        ln(np.ones((2, 4)))


def test_rotary_rows_kept_on_the_device_follow_positions_dtype_and_parameters():
    """A forward pass moves the rotation's rows to the device once and every block reuses
    them (on a GPU each move waits for the device): new positions of the same shape, another
    dtype or another base must still get their own rows."""
    from attnlab.nn.layers import RotaryEmbedding

    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 4, 8))
    k = rng.standard_normal((1, 1, 4, 8))
    calls = [(RotaryEmbedding(8), np.arange(4), np.float32), (RotaryEmbedding(8), np.arange(4, 8), np.float32),
             (RotaryEmbedding(8), np.arange(4, 8), np.float64), (RotaryEmbedding(8, theta=500.0), np.arange(4, 8),
                                                                  np.float64),
             (RotaryEmbedding(8), np.arange(4), np.float32)]
    for rope, positions, dtype in calls:
        want_q, want_k = rope(q.astype(dtype), k.astype(dtype), positions)
        got_q, got_k = rope(torch.from_numpy(q.astype(dtype)), torch.from_numpy(k.astype(dtype)), positions)
        tol = 1e-6 if dtype == np.float32 else 1e-13
        assert got_q.dtype == getattr(torch, np.dtype(dtype).name)
        assert np.abs(got_q.numpy() - want_q).max() < tol and np.abs(got_k.numpy() - want_k).max() < tol
