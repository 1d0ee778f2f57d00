"""The metrics of attnlab.inspect: values and gradients against torch autograd (float64), per
sequence tokens and positions, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnlab.inspect import Metric, activation_patching, cross_entropy, log_prob, logit_diff, probability  # noqa: E402


def _torch(kind, logits, **kw):
    x = torch.tensor(logits, requires_grad=True)
    b = torch.arange(x.shape[0])
    pos = torch.as_tensor(kw.get("position", -1)) % x.shape[1]
    rows = x[b, pos]  # (B, V)
    if kind == "logit_diff":
        v = (rows[b, torch.as_tensor(kw["good"])] - rows[b, torch.as_tensor(kw["bad"])]).mean()
    elif kind == "log_prob":
        v = torch.log_softmax(rows, -1)[b, torch.as_tensor(kw["token"])].mean()
    elif kind == "probability":
        v = torch.softmax(rows, -1)[b, torch.as_tensor(kw["token"])].mean()
    else:
        v = torch.nn.functional.cross_entropy(x.flatten(0, -2), torch.as_tensor(kw["targets"]).flatten())
    v.backward()
    return v.item(), x.grad.numpy()


CASES = [
    ("logit_diff", logit_diff, dict(good=3, bad=5)),
    ("logit_diff", logit_diff, dict(good=[3, 1, 0], bad=[5, 5, 2], position=[4, 2, 3])),
    ("log_prob", log_prob, dict(token=6)),
    ("log_prob", log_prob, dict(token=[6, 0, 2], position=-2)),
    ("probability", probability, dict(token=[1, 2, 3], position=[0, 1, 4])),
]


@pytest.mark.parametrize("kind, make, kw", CASES)
def test_token_metrics_equal_torch_autograd(kind, make, kw):
    logits = np.random.default_rng(0).normal(size=(3, 5, 7)) * 3
    metric = make(**kw)
    want, grad = _torch(kind, logits, **kw)
    assert isinstance(metric, Metric)
    assert metric(logits) == pytest.approx(want, abs=1e-12)
    got = metric.grad(logits)
    assert got.shape == logits.shape and got.dtype == logits.dtype
    np.testing.assert_allclose(got, grad, atol=1e-12)
    # float32 logits: a float32 gradient
    assert metric.grad(logits.astype(np.float32)).dtype == np.float32


def test_cross_entropy_equals_torch_with_ignored_positions():
    logits = np.random.default_rng(1).normal(size=(2, 4, 6))
    targets = np.array([[1, 5, -100, 0], [2, -100, 3, 3]])
    metric = cross_entropy(targets)
    x = torch.tensor(logits, requires_grad=True)
    v = torch.nn.functional.cross_entropy(x.flatten(0, -2), torch.as_tensor(targets).flatten())
    v.backward()
    assert metric(logits) == pytest.approx(v.item(), abs=1e-12)
    np.testing.assert_allclose(metric.grad(logits), x.grad.numpy(), atol=1e-12)


def test_an_unbatched_sequence_is_a_batch_of_one():
    logits = np.random.default_rng(2).normal(size=(5, 7))
    targets = np.arange(5) % 7
    for one, batch in [(logit_diff(1, 2),) * 2, (log_prob(3, position=1),) * 2, (probability(4),) * 2,
                       (cross_entropy(targets), cross_entropy(targets[None]))]:
        assert one(logits) == pytest.approx(batch(logits[None]))
        np.testing.assert_allclose(one.grad(logits), batch.grad(logits[None])[0])


def test_activation_patching_takes_a_metric():
    from attnlab.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2),
                 rng=np.random.default_rng(0))
    clean, corrupted = np.array([[1, 2, 3]]), np.array([[1, 4, 3]])
    metric = logit_diff(5, 6)
    got = activation_patching(model, clean, corrupted, metric)
    assert got[0, 1] == pytest.approx(metric(model(clean)), abs=1e-5)


def test_metric_errors_name_what_is_wrong():
    logits = np.zeros((2, 4, 6))
    with pytest.raises(ValueError, match=r"good 9 is outside the vocabulary of the logits \(0..5\)"):
        logit_diff(9, 1)(logits)
    with pytest.raises(ValueError, match=r"position 4 is out of range for 4 positions \(-4..3\)"):
        log_prob(1, position=4)(logits)
    with pytest.raises(ValueError, match=r"token has shape \(3,\), but should be \(\) or \(2,\)"):
        probability([1, 2, 3])(logits)
    with pytest.raises(ValueError, match="token must be token ids >= 0"):
        log_prob(-1)
    with pytest.raises(TypeError, match="good must be an int or a sequence of ints"):
        logit_diff(1.5, 2)
    with pytest.raises(ValueError, match=r"targets has shape \(2, 3\), but should be \(2, 4\)"):
        cross_entropy(np.zeros((2, 3), int))(logits)
    with pytest.raises(ValueError, match="targets hold 6, outside the vocabulary"):
        cross_entropy(np.full((2, 4), 6))(logits)
    with pytest.raises(TypeError, match="a metric takes float logits"):
        logit_diff(1, 2)(np.zeros((2, 4, 6), int))
