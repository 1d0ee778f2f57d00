"""Running an exercise's cases against a learner's function and saying what went wrong."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import numpy as np

from attnlab.exercises._catalog import Case, Exercise
from attnlab.exercises._run import LearnerError, as_array, call

#: float32 cases pass within this much of the reference, relative to its largest value.
FLOAT32_RTOL = 1e-4


@dataclass
class CheckResult:
    """What :func:`attnlab.exercises.check` found.

    Attributes:
        name: the exercise.
        passed: every case agreed with attnlab's reference and, where the model was asked,
            it still answered Paris.
        cases: the number of cases run (up to and including the first that failed).
        total: the number of cases of the exercise.
        failure: the first failure, explained (the case, the shapes, the largest error and
            where, the mistake when it is a known one), or None.
        mistake: the known mistake the failure matched, or None.
        model: what SmolLM2 did with the function (:class:`~attnlab.exercises.plug.ModelCheck`),
            or None when it was not asked.
        note: why the model was not asked, when it was not.
        seed: the seed of the random cases.
    """

    name: str
    passed: bool
    cases: int
    total: int
    failure: str | None = None
    mistake: str | None = None
    model: object | None = None
    note: str = ""
    seed: int = 0

    def __str__(self) -> str:
        if self.failure is None:
            head = f"{self.name}: passed {self.total} random cases (seed {self.seed})"
        else:
            head = f"{self.name}: FAILED {self.failure}"
        out = [head]
        if self.model is not None:
            out.append("  " + str(self.model))
        elif self.note:
            out.append(f"  {self.note}")
        out.append("  passed" if self.passed else "  not passed yet")
        return "\n".join(out)

    __repr__ = __str__


def describe(ex: Exercise, case: Case) -> str:
    """``q (2, 3, 5, 4) float64, k (2, 3, 7, 4) float64, mask=None``: the case's arguments,
    the defaults it leaves included."""
    from attnlab.exercises import tasks

    parts = []
    params = list(inspect.signature(getattr(tasks, ex.name)).parameters.values())
    for i, p in enumerate(params):
        value = case.args[i] if i < len(case.args) else case.kwargs.get(p.name, p.default)
        if isinstance(value, np.ndarray):
            parts.append(f"{p.name} {value.shape} {value.dtype}")
        else:
            parts.append(f"{p.name}={value!r}")
    return ", ".join(parts)


def _dtype_of(case: Case):
    for a in case.args:
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            return a.dtype
    return np.dtype(np.float64)


def _copy(case: Case) -> Case:
    return Case(tuple(a.copy() if isinstance(a, np.ndarray) else a for a in case.args), dict(case.kwargs), case.about)


def _index(idx) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _close(a: np.ndarray, b: np.ndarray, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype == np.bool_ or b.dtype == np.bool_:
        return a.dtype == b.dtype and bool(np.array_equal(a, b))
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(fb)
    scale = float(np.abs(fb[finite]).max()) if finite.any() else 1.0
    with np.errstate(invalid="ignore"):
        return bool(np.allclose(fa, fb, rtol=0.0, atol=rtol * max(scale, 1e-30) + 1e-300, equal_nan=True))


def _outputs(ex: Exercise, value, what: str) -> list[np.ndarray]:
    if len(ex.outputs) == 1:
        return [as_array(value, what)]
    if not isinstance(value, tuple | list) or len(value) != len(ex.outputs):
        got = f"{len(value)} values" if isinstance(value, tuple | list) else f"a {type(value).__name__}"
        raise LearnerError(f"your function returned {got} on {what}; it must return a tuple "
                           f"({', '.join(ex.outputs)})")
    return [as_array(v, what) for v in value]


def _mistake(ex: Exercise, case: Case, got: list[np.ndarray], ref: list[np.ndarray]) -> str | None:
    """The known mistake whose output equals the learner's on ``case`` (and differs from the
    reference there), or None."""
    for m in ex.mistakes:
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wrong = m.fn(*_copy(case).args, **case.kwargs)
        except Exception:  # a mistake that does not apply to this case's shapes
            continue
        if wrong is None:
            continue
        wrong = [np.asarray(w) for w in (wrong if len(ex.outputs) > 1 else [wrong])]
        if all(_close(w, r, 1e-6) for w, r in zip(wrong, ref, strict=True)):
            continue  # this case cannot tell the mistake from the right answer
        if all(_close(g, w, 1e-4) for g, w in zip(got, wrong, strict=True)):
            return m.text
    return None


def compare(ex: Exercise, case: Case, got: list[np.ndarray], ref: list[np.ndarray], rtol: float) -> str | None:
    """Why ``got`` is not ``ref`` (the first output that differs), or None."""
    for name, g, r in zip(ex.outputs, got, ref, strict=True):
        label = name if len(ex.outputs) > 1 else "the output"
        if g.shape != r.shape:
            return f"{label} has shape {g.shape}; it must be {r.shape}"
        want = np.dtype(np.bool_) if ex.dtype == "bool" else _dtype_of(case)
        if g.dtype != want:
            why = "True where the query may attend" if ex.dtype == "bool" else "keep the inputs' dtype"
            return f"{label} is {g.dtype}; it must be {want} ({why})"
        if ex.dtype == "bool":
            if not np.array_equal(g, r):
                idx = tuple(np.argwhere(g != r)[0])
                return (f"{label} differs at {_index(idx)} (query {idx[-2]}, key {idx[-1]}): yours {bool(g[idx])}, "
                        f"attnlab's {bool(r[idx])}; {int((g != r).sum())} of {g.size} entries differ")
            continue
        gf, rf = g.astype(np.float64), r.astype(np.float64)
        bad = ~np.isfinite(gf) & np.isfinite(rf)
        if bad.any():
            idx = tuple(np.argwhere(bad)[0])
            return (f"{label} holds {gf[idx]} at {_index(idx)} where attnlab's is {rf[idx]:.4g} "
                    f"({int(bad.sum())} of {g.size} entries are NaN or infinite)")
        finite = np.isfinite(rf)
        scale = float(np.abs(rf[finite]).max()) if finite.any() else 1.0
        err = np.where(finite, np.abs(gf - rf), np.where(gf == rf, 0.0, np.inf))
        worst = float(err.max()) if err.size else 0.0
        if worst > rtol * max(scale, 1e-30):
            idx = np.unravel_index(int(np.argmax(err)), err.shape)
            return (f"the largest error is {worst:.3g} at {name}{_index(idx)}: yours {gf[idx]:.6g}, attnlab's "
                    f"{rf[idx]:.6g} (the values go up to {scale:.3g}; {int((err > rtol * scale).sum())} of "
                    f"{g.size} entries are off)")
    return None


def run_cases(ex: Exercise, fn, *, seed: int, seconds: float | None) -> tuple[int, int, str | None, str | None]:
    """``(cases run, cases in all, the first failure explained, its mistake)``."""
    cases = ex.cases(np.random.default_rng(seed))
    for i, case in enumerate(cases):
        what = f"case {i + 1} of {len(cases)}"
        about = f" ({case.about})" if case.about else ""
        head = f"{what}{about}: {describe(ex, case)}"
        ref = ex.reference(*_copy(case).args, **case.kwargs)
        ref = [np.asarray(r) for r in (ref if len(ex.outputs) > 1 else [ref])]
        dtype = _dtype_of(case)
        rtol = FLOAT32_RTOL if dtype == np.float32 else ex.rtol
        try:
            value = call(fn, _copy(case).args, dict(case.kwargs), seconds=seconds, what=what)
            got = _outputs(ex, value, what)
        except LearnerError as exc:
            return i + 1, len(cases), f"{head}\n  {exc}", None
        problem = compare(ex, case, got, ref, rtol)
        if problem is None:
            continue
        mistake = _mistake(ex, case, got, ref)
        text = f"{head}\n  {problem}"
        if mistake is not None:
            text += f"\n  the mistake: {mistake}"
        elif dtype == np.float64 and "largest error" in problem and _close(got[0], ref[0], 1e-3):
            text += ("\n  close, but not to float64 precision: is a float32 array or constant used inside? "
                     "Keep the inputs' dtype throughout")
        return i + 1, len(cases), text, mistake
    return len(cases), len(cases), None, None
