"""Optimizers and gradient clipping against torch.optim on the same gradients."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.nn.module import Parameter
from attnlab.train.optim import SGD, Adam, AdamW, clip_grad_norm_

torch = pytest.importorskip("torch", reason="torch is the test oracle for the optimizers")

OPTIMIZERS = {
    "sgd": (SGD, torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "sgd_dampening_wd": (
        SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1}
    ),
    "sgd_nesterov": (SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam_defaults": (Adam, torch.optim.Adam, {}),
    "adam": (Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}),
    "adam_wd_amsgrad": (Adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    "adamw_defaults": (AdamW, torch.optim.AdamW, {}),
    "adamw": (AdamW, torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.3}),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_torch(name, dtype):
    ours_cls, torch_cls, kw = OPTIMIZERS[name]
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    params = [Parameter(rng.standard_normal(s).astype(dtype)) for s in shapes]
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    opt, topt = ours_cls(params, **kw), torch_cls(tparams, **kw)
    for _ in range(20):
        for p, tp in zip(params, tparams, strict=True):
            g = rng.standard_normal(p.shape).astype(dtype)
            p.grad, tp.grad = g, torch.tensor(g.copy())
        opt.step()
        topt.step()
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for p, tp in zip(params, tparams, strict=True):
        assert p.data.dtype == dtype
        np.testing.assert_allclose(p.data, tp.detach().numpy(), rtol=tol, atol=tol)


def test_defaults_are_torchs():
    p = [Parameter(np.zeros(1))]
    adam, adamw = Adam(p), AdamW(p)
    assert (adam.lr, adam.betas, adam.eps, adam.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert adamw.weight_decay == 0.01


def test_params_without_grad_are_skipped_and_zero_grad_clears():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    a.grad = np.ones(2)
    opt = Adam([a, b], lr=0.1)
    opt.step()
    assert np.all(b.data == 1) and np.all(a.data < 1)
    opt.zero_grad()
    assert a.grad is None


@pytest.mark.parametrize("max_norm,norm_type", [(1.0, 2.0), (100.0, 2.0), (0.5, 1.0), (0.3, float("inf"))])
def test_clip_grad_norm_matches_torch(max_norm, norm_type):
    rng = np.random.default_rng(1)
    params = [Parameter(np.zeros(s)) for s in [(3, 3), (4,)]]
    tparams = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in [(3, 3), (4,)]]
    for p, tp in zip(params, tparams, strict=True):
        g = rng.standard_normal(p.shape)
        p.grad, tp.grad = g, torch.tensor(g.copy())
    total = clip_grad_norm_(params, max_norm, norm_type)
    t_total = torch.nn.utils.clip_grad_norm_(tparams, max_norm, norm_type)
    assert abs(total - t_total.item()) <= 1e-12 * t_total.item()
    for p, tp in zip(params, tparams, strict=True):
        np.testing.assert_allclose(p.grad, tp.grad.numpy(), rtol=1e-12)


def test_bad_optimizer_arguments():
    p = [Parameter(np.zeros(1))]
    with pytest.raises(ValueError, match="lr"):
        SGD(p, lr=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        Adam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="empty"):
        Adam([])
