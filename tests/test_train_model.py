"""TinyTransformer against its torch twin: every parameter gradient, and the loss trajectory
of 50 Adam steps on the same batches."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.models.tiny_torch import copy_to_torch, torch_tiny_transformer
from attnlab.nn import CrossEntropyLoss
from attnlab.train.optim import Adam, clip_grad_norm_
from attnlab.train.tasks import RecallTask

torch = pytest.importorskip("torch", reason="torch is the test oracle for training")

from helpers import TOL  # noqa: E402
from helpers import grad_rel_err as rel_err  # noqa: E402

TASK = RecallTask()


def _pair(dtype: str, activation: str = "gelu", seed: int = 0):
    cfg = TinyTransformerConfig(
        vocab_size=TASK.vocab_size, context_length=TASK.seq_len, d_model=16, n_heads=2,
        n_layers=2, d_ff=24, activation=activation, dtype=dtype,
    )
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # move LayerNorm/bias off their ones/zeros
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    twin = torch_tiny_transformer(cfg)
    copy_to_torch(model, twin)
    return model, twin


def _torch_loss(twin, ids, targets):
    logits = twin(torch.from_numpy(ids))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1)
    )


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_model_gradients_match_torch(dtype, activation):
    model, twin = _pair(dtype, activation)
    ids, targets = TASK.sample(4, rng=np.random.default_rng(2))
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model(ids), targets)
    model.zero_grad()
    model.backward(loss_fn.backward())
    t_loss = _torch_loss(twin, ids, targets)
    t_loss.backward()
    tol = TOL[np.dtype(dtype).type]
    assert abs(loss - t_loss.item()) <= tol * abs(t_loss.item())
    tparams = dict(twin.named_parameters())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(tparams)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, tparams[name].grad.numpy()) <= tol, name


def test_fifty_adam_steps_follow_torchs_trajectory():
    model, twin = _pair("float64")
    opt = Adam(model.parameters(), lr=3e-3)
    t_opt = torch.optim.Adam(twin.parameters(), lr=3e-3)
    loss_fn = CrossEntropyLoss()
    rng = np.random.default_rng(3)
    diffs = []
    for _ in range(50):
        ids, targets = TASK.sample(8, rng=rng)
        loss = loss_fn(model(ids), targets)
        model.zero_grad()
        model.backward(loss_fn.backward())
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_opt.zero_grad()
        t_loss = _torch_loss(twin, ids, targets)
        t_loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        t_opt.step()
        diffs.append(abs(loss - t_loss.item()))
    assert max(diffs) <= 1e-6, max(diffs)
    print(f"trajectory: max |loss - torch loss| over 50 Adam steps = {max(diffs):.3g}")
    for name, t in twin.state_dict().items():
        assert np.abs(model.state_dict()[name] - t.numpy()).max() <= 1e-6, name


def test_attention_maps_are_causal_rows_summing_to_one():
    model, _ = _pair("float64")
    ids, _ = TASK.sample(1, rng=np.random.default_rng(4))
    maps = model.attention_maps(ids[0])
    T = ids.shape[1]
    assert maps.shape == (2, 2, T, T)
    assert np.allclose(maps.sum(-1), 1)
    assert np.all(np.triu(maps, k=1) == 0)
    assert model.training  # restored


def test_model_rejects_bad_ids():
    model, _ = _pair("float32")
    with pytest.raises(ValueError, match="context_length"):
        model(np.zeros((1, TASK.seq_len + 1), dtype=np.int64))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 32\)"):
        model(np.full((1, 4), 32))
