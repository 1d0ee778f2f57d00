"""Layers on ``array_api_strict`` arrays (``Module.to``): their forward passes use only the Array
API standard (2022.12, no boolean indexing, no data-dependent shapes), keep the arrays on their
device (``device1`` refuses any conversion to NumPy) and equal the NumPy path."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.core import _namespace
from attnlab.nn import Dropout, KVCache, Linear, MultiheadAttention, TransformerBlock
from helpers import LAYER_CASES, normal, perturbed, rel_err, run_case

xs = pytest.importorskip("array_api_strict")
pytest.importorskip("array_api_compat")

DEVICE = xs.Device("device1")
CPU = xs.Device("CPU_DEVICE")
TOL = {"float32": 1e-5, "float64": 1e-12}  # max abs error relative to the reference's largest entry
WORST: dict[str, float] = {}


@pytest.fixture(autouse=True)
def strict_standard():
    """The oldest standard the path claims, with the optional data-dependent features off."""
    with xs.ArrayAPIStrictFlags(api_version="2022.12", boolean_indexing=False, data_dependent_shapes=False):
        yield


@pytest.fixture(scope="module", autouse=True)
def report_worst():
    yield
    print("\nworst relative error on array_api_strict:", {k: f"{v:.2g}" for k, v in sorted(WORST.items())})


def dev(a: np.ndarray):
    """A NumPy array as a strict array on ``device1`` (which cannot be converted back to NumPy)."""
    return xs.asarray(a, device=DEVICE)


def close(got, want: np.ndarray, dtype: str) -> None:
    """``got`` is a strict array on device1 of ``dtype`` equal to ``want`` within tolerance."""
    assert isinstance(got, xs._array_object.Array), type(got)
    assert got.device == DEVICE and got.dtype == getattr(xs, dtype)
    err = rel_err(np.asarray(got.to_device(CPU)), np.asarray(want))
    WORST[dtype] = max(WORST.get(dtype, 0.0), err)
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_on_strict_arrays_equals_numpy_path(case, dtype):
    want = run_case(case, dtype)
    got = run_case(case, dtype, dev, convert=lambda layer: layer.to(xs, device=DEVICE))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            close(g, w, dtype)


def test_dropout_in_training_draws_numpys_mask():
    x = normal((2, 5, 8), "float64")
    close(Dropout(0.4, rng=np.random.default_rng(1))(dev(x)), Dropout(0.4, rng=np.random.default_rng(1))(x), "float64")
    mha = [MultiheadAttention(8, 2, dropout=0.3, batch_first=True, rng=np.random.default_rng(4), dtype=np.float64)
           for _ in range(2)]
    want = mha[0](x, x, x)
    got = mha[1].to(xs, device=DEVICE)(dev(x), dev(x), dev(x))
    for g, w in zip(got, want, strict=True):
        close(g, w, "float64")


def test_kv_cache_on_strict_arrays_decodes_as_the_whole_sequence():
    block = perturbed(TransformerBlock(8, 2, 12, rng=np.random.default_rng(0))).eval()
    x = normal((2, 6, 8), "float32")
    want = block(x)
    block.to(xs, device=DEVICE)
    cache = KVCache()
    steps = [block(dev(x[:, :4]), cache=cache), block(dev(x[:, 4:5]), cache=cache), block(dev(x[:, 5:]), cache=cache)]
    close(xs.concat(steps, axis=1), want, "float32")


def test_weights_come_back_from_a_device_that_refuses_numpy():
    block = perturbed(TransformerBlock(8, 2, 12, rng=np.random.default_rng(0), dtype=np.float64))
    before = block.state_dict()
    block.to(xs, device=DEVICE)
    assert all(p.data.device == DEVICE for p in block.parameters())
    for name, arr in block.state_dict().items():  # copied to the host
        np.testing.assert_array_equal(arr, before[name])
    block.to(np)
    for name, arr in block.state_dict().items():
        np.testing.assert_array_equal(arr, before[name])


def test_inputs_on_another_device_are_refused():
    layer = Linear(3, 2, rng=np.random.default_rng(0)).to(xs, device=DEVICE)
    with pytest.raises(TypeError, match=r"x is array_api_strict\.Array on .*CPU_DEVICE.*, but the layer's weights "
                                        r"are array_api_strict\.Array on .*device1"):
        layer(xs.ones((1, 3), dtype=xs.float32))


def test_backward_after_a_strict_forward_says_it_is_numpy_only():
    layer = Linear(3, 2, rng=np.random.default_rng(0)).to(xs, device=DEVICE)
    layer(dev(np.ones((1, 3), np.float32)))
    with pytest.raises(TypeError, match=r"Linear\.backward\(\) .* ran on array_api_strict\.Array"):
        layer.backward(np.ones((1, 2), np.float32))


def test_a_library_lacking_what_the_layers_call_is_named(monkeypatch):
    monkeypatch.delattr(xs, "take")
    monkeypatch.setattr(_namespace, "_CHECKED", set())
    layer = Linear(3, 2, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"attnlab's layers cannot compute on array_api_strict\.Array arrays: their "
                                        r"namespace 'array_api_strict' lacks take \(Array API standard 2022\.12\)"):
        layer.to(xs)
    assert type(layer.weight.data) is np.ndarray
