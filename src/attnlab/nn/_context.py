"""The state of a call, kept in context variables instead of on the modules: the tape (what
the backward passes will read) and the hooks attached to the call.

Two threads running one model each see their own: a thread starts with an empty context
(Python < 3.14 does not copy the starting thread's context into a new thread), so hooks
attached with ``with model.hooks(...)`` in one thread are not seen by calls in another, and
each thread keeps its own tape. ``asyncio`` tasks and ``contextvars.copy_context().run``
see the hooks of the context they were started from (the hooks are immutable, so sharing
them is safe); a tape is used only by the thread that made it.

- **The tape.** A module called in training mode (or in a call that keeps its tape, see
  :func:`attached`'s ``keep``) saves what its backward pass reads with
  :meth:`Tape.push`; ``module.backward`` takes it back with :meth:`Tape.pop`. Per module
  the tape holds a stack, so a module called twice in one forward pass has two entries,
  taken in reverse order by two backward calls. A new top-level call (one that no other
  module's forward pass made) replaces what the module saved in an earlier call: one
  forward pass, one backward pass, as torch without ``retain_graph``. The backward pass
  runs in the thread that ran the forward pass (the tape is that thread's).
- **The hooks.** ``(fn, name)`` pairs per hook point for the forward pass and for the
  backward pass, set for the duration of a ``with`` block (:func:`attached`); nested blocks
  add to the hooks already attached.
- **The fast kernels' rule.** :func:`may_fuse` is the one place that says whether a call may
  take a fused inference kernel (one that keeps nothing for backward and calls no hook point
  inside it).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar

__all__ = ["CallHooks", "Tape", "attached", "current_hooks", "detached", "frozen_parameters", "keeping", "may_fuse",
           "parameters_frozen", "tape"]


class _Stack:
    """What one module saved in one top-level call (``generation``), newest last; ``freed``
    after a backward pass took the last entry."""

    __slots__ = ("freed", "generation", "items")

    def __init__(self, generation: int, items: list) -> None:
        self.generation, self.items, self.freed = generation, items, False


class Tape:
    """One thread's saved activations: module -> its stack of saved dicts (see the module
    docstring). ``depth`` counts the forward passes in progress (0: the next call is a
    top-level one, which starts a new ``generation``)."""

    __slots__ = ("depth", "generation", "saves", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        # weak keys: a model the thread trained once and dropped is not kept alive by its tape
        self.saves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.generation = 0
        self.depth = 0

    def push(self, module, record) -> None:
        """Save ``record`` for ``module``'s backward pass: on top of what it saved earlier in
        the same top-level call, else in place of it."""
        stack = self.saves.get(module)
        if stack is not None and self.depth and stack.generation == self.generation and not stack.freed:
            stack.items.append(record)
        else:
            self.saves[module] = _Stack(self.generation, [record])

    def peek(self, module, *, missing: str, freed: str):
        """The newest record of ``module``, left in place; a RuntimeError with ``missing``
        when it saved nothing, with ``freed`` when a backward pass already took it."""
        stack = self.saves.get(module)
        if stack is None or not stack.items:
            raise RuntimeError(freed if stack is not None and stack.freed else missing)
        return stack.items[-1]

    def pop(self, module, *, missing: str, freed: str):
        """Take the newest record of ``module`` (the errors of :meth:`peek`)."""
        self.peek(module, missing=missing, freed=freed)
        stack = self.saves[module]
        record = stack.items.pop()
        if not stack.items:
            stack.freed = True
        return record

    def pop_if_any(self, module):
        """The newest record of ``module``, or None (a hook point that was not hooked)."""
        stack = self.saves.get(module)
        if stack is None or not stack.items:
            return None
        record = stack.items.pop()
        if not stack.items:
            stack.freed = True
        return record

    def drop(self, module) -> None:
        """Forget what ``module`` saved (eval mode, or a call that saves nothing for it)."""
        self.saves.pop(module, None)


_TAPE: ContextVar[Tape | None] = ContextVar("attnlab_tape", default=None)


def tape() -> Tape:
    """This thread's tape (made on first use)."""
    t = _TAPE.get()
    if t is None or t.thread != threading.get_ident():  # a context copied into another thread
        t = Tape()
        _TAPE.set(t)
    return t


def existing_tape() -> Tape | None:
    """This thread's tape, or None if it has none yet (nothing to forget)."""
    t = _TAPE.get()
    return t if t is not None and t.thread == threading.get_ident() else None


class CallHooks:
    """The hooks of a call (immutable): ``fwd`` and ``bwd`` map a hook point to its
    ``((fn, name), ...)``; ``keep`` makes every module keep what backward needs whatever its
    mode (``run_with_cache(incl_bwd=True)``)."""

    __slots__ = ("bwd", "fwd", "keep")

    def __init__(self, fwd: Mapping, bwd: Mapping, keep: bool) -> None:
        self.fwd, self.bwd, self.keep = fwd, bwd, keep


_HOOKS: ContextVar[CallHooks | None] = ContextVar("attnlab_hooks", default=None)


#: The hooks attached in this context (None: none, the common case); the hot paths (every
#: module call, every hook point) call this bound method directly.
current_hooks = _HOOKS.get


def keeping() -> bool:
    """Whether this context's call keeps what backward needs in every mode (incl_bwd)."""
    h = _HOOKS.get()
    return h is not None and h.keep


def _merged(old: Mapping, new: Mapping) -> dict:
    out = dict(old)
    for point, fns in new.items():
        out[point] = out.get(point, ()) + tuple(fns)
    return out


@contextlib.contextmanager
def attached(fwd: Mapping | None = None, bwd: Mapping | None = None, *, keep: bool = False) -> Iterator[None]:
    """Attach hooks (``{hook point: ((fn, name), ...)}``) for the ``with`` block, in this
    context only, added to those already attached; ``keep`` makes the block's calls keep
    their tape in eval mode too."""
    old = _HOOKS.get()
    new = CallHooks(_merged(old.fwd if old else {}, fwd or {}), _merged(old.bwd if old else {}, bwd or {}),
                    keep or (old is not None and old.keep))
    token = _HOOKS.set(new)
    try:
        yield
    finally:
        _HOOKS.reset(token)


_FROZEN: ContextVar[bool] = ContextVar("attnlab_frozen_parameters", default=False)

#: Whether the backward passes of this context leave the parameters' gradients alone.
parameters_frozen = _FROZEN.get


@contextlib.contextmanager
def frozen_parameters() -> Iterator[None]:
    """Backward passes in the ``with`` block compute the gradients of the activations (and
    run the backward hooks) but no parameter's: no weight-gradient products, nothing added
    to ``.grad`` (torch's ``requires_grad_(False)`` on every parameter). What the gradient
    methods of :mod:`attnlab.inspect` run in: on SmolLM2 a backward pass then costs about
    what its forward pass does."""
    token = _FROZEN.set(True)
    try:
        yield
    finally:
        _FROZEN.reset(token)


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """No hooks in this context for the ``with`` block (a block recomputed in the backward
    pass, whose forward pass ran with none)."""
    token = _HOOKS.set(None)
    try:
        yield
    finally:
        _HOOKS.reset(token)


def may_fuse(training: bool, points: Iterable = ()) -> bool:
    """Whether a call may take a fused inference kernel, one that keeps nothing for backward
    and calls no hook point inside it: the module is in eval mode, the call keeps no tape,
    no backward hook is attached, and no forward hook sits on ``points`` (the hook points
    the kernel would pass by). The one place that decides it (the one-call attention, the
    compiled decoding step)."""
    if training:
        return False
    h = _HOOKS.get()
    if h is None:
        return True
    if h.keep or h.bwd:
        return False
    return not h.fwd or not any(p in h.fwd for p in points)
