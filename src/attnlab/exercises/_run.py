"""Calling a learner's function safely: a time limit, and every fault (an exception, a wrong
type, shape or dtype, NaN, too slow) turned into one message about the learner's code,
never a traceback from attnlab's internals."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../attnlab: frames inside it are attnlab's


class LearnerError(Exception):
    """A fault of the learner's function; the message is written for the learner."""


class _TooSlow(BaseException):
    """Raised by the alarm inside the learner's code (a BaseException, so that a bare
    ``except Exception`` in the learner's function cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`_TooSlow` in this thread after ``seconds`` (wall time), where the
    platform allows (the main thread of a Unix process); elsewhere nothing is interrupted
    and :func:`call` compares the time taken afterwards."""
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def ring(signum, frame):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def where_in_learner_code(exc: BaseException) -> str:
    """``" (file.py, line 12, in softmax: `return e / s`)"`` for the innermost frame of the
    traceback outside attnlab, or ``""``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_PACKAGE)]
    if not frames:
        return ""
    f = frames[-1]
    line = f" `{f.line.strip()}`" if f.line else ""
    return f" ({Path(f.filename).name}, line {f.lineno}, in {f.name}:{line})"


def exit_message(exc: SystemExit, what: str) -> str:
    """The learner's function called ``sys.exit`` (or ``exit()``, ``quit()``) on ``what``."""
    return (f"your function called sys.exit({'' if exc.code is None else repr(exc.code)}) on {what}: it must "
            "return its result")


def call(fn, args: tuple, kwargs: dict, *, seconds: float | None, what: str):
    """``fn(*args, **kwargs)``, or :class:`LearnerError` naming ``what`` (the case) when it
    raises or takes longer than ``seconds``."""
    start = time.perf_counter()
    try:
        with time_limit(seconds), np.errstate(all="ignore"):
            out = fn(*args, **kwargs)
    except _TooSlow:
        raise LearnerError(f"your function took more than {seconds:g} s on {what} (the time limit): "
                           "is there a loop over single numbers that NumPy could do at once?") from None
    except RecursionError:
        raise LearnerError(f"your function recursed without end on {what}") from None
    except SystemExit as exc:
        raise LearnerError(exit_message(exc, what)) from None
    except Exception as exc:  # the learner's bug, reported as theirs
        raise LearnerError(f"your function raised {type(exc).__name__}: {exc}{where_in_learner_code(exc)} "
                           f"on {what}") from None
    took = time.perf_counter() - start
    if seconds is not None and took > seconds:
        raise LearnerError(f"your function took {took:.1f} s on {what}, more than the {seconds:g} s limit")
    return out


def as_array(value, what: str) -> np.ndarray:
    """``value`` as an array of numbers or bools, else :class:`LearnerError`."""
    if value is None:
        raise LearnerError(f"your function returned None on {what}: did it forget to `return`?")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise LearnerError(f"your function returned a {type(value).__name__} that is not an array on {what} "
                           f"({exc})") from None
    if arr.dtype.kind not in "biuf":
        raise LearnerError(f"your function returned a {type(value).__name__} of {arr.dtype} on {what}: it must "
                           "return a NumPy array of numbers")
    return arr
