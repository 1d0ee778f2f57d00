"""Named hook points: read or replace any activation of a model, and its gradient, one
mechanism for all.

Every layer marks its activations with :class:`HookPoint`\\ s, identity modules that do
nothing until a hook is attached. A module's hook names are the dotted paths of its hook
points, in the order the forward pass reaches them, with the names TransformerLens uses
(``blocks.0.attn.hook_pattern``, ``blocks.3.hook_resid_post``, ``ln_final.hook_normalized``).
Blocks count from 0 here, as in TransformerLens; attnlab's *layer* numbers count the
embeddings as layer 0, so hook ``blocks.{k-1}.hook_resid_post`` is layer ``k``.

Three calls on every :class:`~attnlab.nn.Module` (a model, a block, one attention layer):

- ``module.run_with_cache(*args, names_filter=None, incl_bwd=False, grad_out=None,
  **kwargs) -> (output, cache)``: the output and an :class:`ActivationCache` of copies of
  the activations whose names pass the filter (memory grows only with what was asked
  for). With ``incl_bwd=True`` the call then runs ``module.backward(grad_out)``
  (``grad_out``: the gradient of a loss with respect to the output) and caches each
  activation's gradient under ``name + "_grad"``, as TransformerLens does; like
  TransformerLens's ``output.backward()``, that backward pass also adds to the
  parameters' ``.grad``. It works in eval mode too (the call keeps what its backward
  needs; dropout follows the mode).
- ``module.run_with_hooks(*args, fwd_hooks=[(name or predicate, fn)], bwd_hooks=[...],
  **kwargs)``: each forward hook ``fn(activation, name)`` returns None to read or an array
  of the same shape and dtype to replace the activation (patching, ablation); the
  backward hooks belong to the call: a ``module.backward(grad)`` after it runs them.
- ``with module.hooks(fwd_hooks, bwd_hooks): ...``: the same around any code, ``generate``
  included (hooks then run once per decoding step, on that step's tokens), and around a
  forward pass and its ``backward``.

A backward hook ``fn(grad, name)`` receives the gradient of the loss with respect to the
activation (what the hook point returned in the forward pass, after any forward hook's
replacement) and returns None to read it or an array of the same shape and dtype that
replaces it in the rest of the backward pass. Backward hooks are those attached around
the *forward* pass (as torch's module backward hooks, which must be registered before the
forward pass): attaching them around ``backward`` alone is an error.

Through a forward hook's replacement the gradient flows as through an assignment: the
elements the hook left unchanged pass their gradient on to the activation, those it
changed pass none (a zero-ablated head, a patched position: torch's gradient for
``z[:, :, h] = 0`` or a constant patch). A hook that computes a new value from the old one
(``x * 2``) is treated the same way, as a constant where it changed the value.

**Hooks belong to the call, not to the model.** They live in a context variable
(:mod:`attnlab.nn._context`) for the duration of the call or the ``with`` block, so two
threads running one model with different hooks each get their own results, and the
activations kept for backward live on the calling thread's tape. A thread started
*inside* a ``with model.hooks(...)`` block does not see those hooks (Python starts a thread
with an empty context; attach them inside the thread, or run the thread's work in
``contextvars.copy_context().run``). ``train()``/``eval()`` is the model's state, shared
by every thread: set it before threads start.

Hooks are removed when the call or the ``with`` block ends, also when it raises. A hook
receives the live activation (or gradient): keep a copy if you keep it (``run_with_cache``
does). For an unbatched call (one sequence without its batch axis) the residual-stream
hooks have no batch axis either, while the attention's own hooks (``attn.hook_q`` ...
``attn.hook_z``) keep a batch axis of 1, as the layer computes with one.
With no hook attached a hook point costs one context-variable read.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from attnlab._validation import fmt_shape
from attnlab.core._namespace import array_type, device, is_numpy, namespace, writeable
from attnlab.nn import _context
from attnlab.nn.module import Module

__all__ = ["ActivationCache", "HookPoint", "hook_points", "record_layers"]

_hooks_now = _context.current_hooks

HookFn = Callable[[np.ndarray, str], "np.ndarray | None"]


class HookPoint(Module):
    """An identity layer that marks an activation: ``hook(x)`` returns ``x``, or what the
    hook functions attached in this call make of it; ``hook.backward(grad)`` returns the
    gradient, or what the call's backward hooks make of it (see :mod:`attnlab.nn.hooks`).

    ``opt_in=True`` marks a point that changes how its layer computes when hooked (a
    block's per-head inputs): only a hook that names it attaches there, not
    ``names_filter=None`` or a predicate.

    >>> hp = HookPoint()
    >>> hp(np.ones(2))
    array([1., 1.])
    """

    def __init__(self, *, opt_in: bool = False) -> None:
        super().__init__()
        self.opt_in = bool(opt_in)

    @property
    def _fns(self) -> tuple:
        """The ``((fn, name), ...)`` forward hooks attached to this point in this context."""
        h = _hooks_now()
        return () if h is None else h.fwd.get(self, ())

    @property
    def hooked(self) -> bool:
        """Whether a forward or a backward hook is attached to this point in this context
        (a layer then computes what it would otherwise skip or overwrite)."""
        h = _hooks_now()
        return h is not None and (self in h.fwd or self in h.bwd)

    def __call__(self, x):
        h = _hooks_now()
        if h is None and not self.training:  # the hot path: nothing attached, nothing kept
            return x
        fwd = bwd = ()
        if h is not None:
            fwd, bwd = h.fwd.get(self, ()), h.bwd.get(self, ())
        keep = self._array_type is None and (self.training or (h is not None and h.keep))  # moved: keeps nothing
        if not fwd and not bwd:
            if keep:  # nothing for backward: forget what an earlier hooked call kept here
                tape = _context.existing_tape()
                if tape is not None:
                    tape.drop(self)
            return x
        before = None
        if keep and isinstance(x, np.ndarray) and not all(getattr(fn, "reads_only", False) for fn, _ in fwd):
            before = x.copy()  # a hook may write into x: what it changed stops the gradient
        for fn, name in fwd:
            out = fn(x, name)
            if out is not None:
                x = _replacement(out, x, name)
        if keep:
            passes = None  # the elements whose gradient reaches the activation (None: all)
            if before is not None:
                same = x == before
                passes = None if same.all() else (False if not same.any() else same)
            if bwd or passes is not None:
                _context.tape().push(self, (bwd, passes))
            else:  # read only: the gradient passes unchanged
                _context.tape().drop(self)
        return x

    def forward(self, x):
        return self(x)

    def backward(self, grad_output):
        """The gradient with respect to the activation's input: the call's backward hooks
        run on ``grad_output`` (each may replace it), then elements a forward hook changed
        pass no gradient."""
        tape = _context.existing_tape()
        record = None if tape is None else tape.pop_if_any(self)
        if record is None:
            return grad_output
        bwd, passes = record
        g = grad_output
        for fn, name in bwd:
            out = fn(g, name)
            if out is not None:
                g = _replacement(out, g, name, what="gradient")
        if passes is False:
            return np.zeros_like(g)
        return g if passes is None else g * passes

    def __repr__(self) -> str:
        return "HookPoint()"


def _replacement(out, x, name: str, what: str = "activation") -> np.ndarray:
    """A hook's returned array, checked against the activation (or gradient) it replaces,
    as a fresh array (the pass may update it in place)."""
    kind = "backward hook" if what == "gradient" else "hook"
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise TypeError(f"the {kind} on {name!r} returned {type(out).__name__}: a hook returns None "
                        f"(read only) or an array {fmt_shape(x.shape)} of dtype {x.dtype}")
    if (type(x) is np.ndarray) != is_numpy(out) or not (type(x) is np.ndarray or _same_place(out, x)):
        where = "" if type(x) is np.ndarray else f" on {device(x)}"
        raise TypeError(f"the {kind} on {name!r} returned {array_type(out)}, but the {what} is "
                        f"{array_type(x)}{where}: return an array of the {what}'s library and device "
                        "(e.g. built with its namespace, like zeros_like)")
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise ValueError(f"the {kind} on {name!r} returned an array {fmt_shape(tuple(out.shape))} of dtype "
                         f"{out.dtype}, but the {what} is {fmt_shape(tuple(x.shape))} of dtype {x.dtype}")
    return _copy(out)


def _same_place(a, b) -> bool:
    """Whether the arrays ``a`` and ``b`` are of one library, on one device."""
    try:
        return namespace(a, b) is not np and device(a) == device(b)
    except TypeError:
        return False


def _copy(x):
    """A fresh copy of the array ``x`` (an immutable JAX array is itself)."""
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    return namespace(x).asarray(x, copy=True) if writeable(x) else x


def hook_points(module: Module, prefix: str = "") -> Iterator[tuple[str, HookPoint]]:
    """``(name, HookPoint)`` pairs of ``module`` in forward order. A module renames its
    children in hook names through its ``_hook_alias`` (``{"ln_1": "ln1"}``), so the names
    are TransformerLens's while the parameter names stay attnlab's."""
    alias = getattr(module, "_hook_alias", {})
    for name, child in module._modules.items():
        full = prefix + alias.get(name, name)
        if isinstance(child, HookPoint):
            yield full, child
        else:
            yield from hook_points(child, full + ".")


def _check_name_filter(names_filter, known: list[str]) -> Callable[[str], bool]:
    """``names_filter`` (None, a name, a list of names or a predicate) as a predicate;
    unknown names raise a KeyError with the closest known names."""
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        names_filter = [names_filter]
    if callable(names_filter):
        return names_filter
    if isinstance(names_filter, Iterable) and not isinstance(names_filter, bytes | Mapping):
        wanted = list(names_filter)
        for name in wanted:
            if not isinstance(name, str):
                raise TypeError(f"names_filter must be a hook name, a list of names or a predicate "
                                f"name -> bool, got a list holding {type(name).__name__}")
            _check_known(name, known)
        chosen = set(wanted)
        return chosen.__contains__
    raise TypeError(f"names_filter must be None, a hook name, a list of names or a predicate "
                    f"name -> bool, got {type(names_filter).__name__}")


def _check_known(name: str, known: list[str]) -> None:
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else f"; there are {len(known)} (see hook_names())"
        raise KeyError(f"no hook point is named {name!r}{hint}")


def _plan(points: dict[str, HookPoint], hook_list, what: str) -> dict[HookPoint, tuple]:
    """``{hook point: ((fn, name), ...)}`` of a list of ``(name or predicate, fn)``."""
    known = list(points)
    if isinstance(hook_list, tuple) and len(hook_list) == 2 and callable(hook_list[1]):
        hook_list = [hook_list]
    plan: dict[str, list] = {}
    for item in hook_list:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"{what} must be a list of (name or predicate, fn) pairs, got an item "
                            f"of type {type(item).__name__}")
        target, fn = item
        if not callable(fn):
            arg = "grad" if what == "bwd_hooks" else "activation"
            raise TypeError(f"the hook for {target!r} is {type(fn).__name__}, not a function fn({arg}, name)")
        if isinstance(target, str):
            _check_known(target, known)
            plan.setdefault(target, []).append(fn)
        elif callable(target):
            for name in known:
                if target(name) and not points[name].opt_in:
                    plan.setdefault(name, []).append(fn)
        else:
            raise TypeError(f"a hook's target must be a hook name or a predicate name -> bool, "
                            f"got {type(target).__name__}")
    return {points[name]: tuple((fn, name) for fn in fns) for name, fns in plan.items()}


@contextlib.contextmanager
def hooks(module: Module, fwd_hooks=(), bwd_hooks=(), *, keep: bool = False) -> Iterator[Module]:
    """Attach ``fwd_hooks`` and ``bwd_hooks`` to ``module``'s hook points for the ``with``
    block, in this context (thread) only; removed on exit, also on an error. ``keep``: the
    block's calls keep what backward needs in eval mode too."""
    points = dict(hook_points(module))
    fwd = _plan(points, fwd_hooks, "fwd_hooks")
    bwd = _plan(points, bwd_hooks, "bwd_hooks")
    with _context.attached(fwd, bwd, keep=keep):
        yield module


class ActivationCache(Mapping):
    """Activations recorded by :meth:`~attnlab.nn.Module.run_with_cache`: a read-only
    mapping from hook name to a copy of the activation (a NumPy array, not writeable; an
    array of the weights' library and device for a model moved with
    :meth:`~attnlab.nn.Module.to`), in forward order.

    ``cache["blocks.0.attn.hook_pattern"]`` is ``(B, H, T, T)``; a missing name raises a
    ``KeyError`` naming the closest recorded ones.
    """

    def __init__(self, arrays: dict[str, np.ndarray]):
        self._arrays = arrays

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self._arrays[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), list(self._arrays), n=3, cutoff=0.5)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise KeyError(f"{name!r} is not in this cache ({len(self._arrays)} names recorded{hint})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        more = ", ..." if len(self) > 4 else ""
        return f"ActivationCache({len(self)} activations: {', '.join(list(self)[:4])}{more})"

    @property
    def nbytes(self) -> int:
        """The bytes the recorded arrays hold."""
        return sum(a.nbytes for a in self._arrays.values())


def _recorder(store: dict, suffix: str = "") -> HookFn:
    def record(x, name):
        a = _copy(x)  # later in-place updates must not reach the cache
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
        store[name + suffix] = a

    record.reads_only = True  # changes nothing: the hook point need not watch for writes
    return record


def run_with_cache(module: Module, *args, names_filter=None, incl_bwd: bool = False, grad_out=None, **kwargs):
    """``(module(*args, **kwargs), cache)``: see :mod:`attnlab.nn.hooks`.

    With ``incl_bwd=True``, ``module.backward(grad_out)`` runs in the same call and the
    cache also holds ``name + "_grad"``, the gradient of each cached activation, after the
    activations (both in forward order).

    Raises:
        ValueError: ``incl_bwd=True`` without ``grad_out``, or ``grad_out`` without
            ``incl_bwd=True``; the errors of ``module.backward`` (``grad_out`` of the
            wrong shape or dtype, quantized weights).
        TypeError: ``incl_bwd=True`` on a module moved to another array library.
    """
    if incl_bwd and grad_out is None:
        raise ValueError("incl_bwd=True needs grad_out, the gradient of the loss with respect to the output "
                         "(e.g. of the logits (B, T, V) of a decoder): attnlab runs backward(grad_out) itself")
    if grad_out is not None and not incl_bwd:
        raise ValueError("grad_out is read only with incl_bwd=True (the gradients are then cached too)")
    if incl_bwd and module._array_type is not None:
        raise TypeError(f"run_with_cache(incl_bwd=True) runs a backward pass, which attnlab computes on NumPy "
                        f"arrays, but {type(module).__name__}'s weights are {module._array_type}: call .to(np) "
                        "first (or train in torch: attnlab.interop.to_torch)")
    points = dict(hook_points(module))
    known = list(points)
    keep = _check_name_filter(names_filter, known)
    store: dict[str, np.ndarray] = {}
    grads: dict[str, np.ndarray] = {}
    named = {names_filter} if isinstance(names_filter, str) else \
        set(names_filter) if isinstance(names_filter, list | tuple | set | frozenset) else set()
    wanted = [name for name in known if keep(name) and (name in named or not points[name].opt_in)]
    record, record_grad = _recorder(store), _recorder(grads, "_grad")
    with hooks(module, [(name, record) for name in wanted],
               [(name, record_grad) for name in wanted] if incl_bwd else (), keep=bool(incl_bwd)):
        out = module(*args, **kwargs)
        if incl_bwd:
            module.backward(grad_out)
    order = {name: i for i, name in enumerate(known)}
    arrays = dict(sorted(store.items(), key=lambda kv: order[kv[0]]))
    arrays.update(sorted(grads.items(), key=lambda kv: order[kv[0][:-5]]))
    return out, ActivationCache(arrays)


def run_with_hooks(module: Module, *args, fwd_hooks=(), bwd_hooks=(), **kwargs):
    """``module(*args, **kwargs)`` with ``fwd_hooks`` attached for the call, and
    ``bwd_hooks`` for the backward pass that follows it."""
    with hooks(module, fwd_hooks, bwd_hooks):
        return module(*args, **kwargs)


def record_layers(model: Module, run: Callable[[], object], *, maps: bool = True):
    """``(output, hidden, weights)`` of ``run()``, a forward pass of ``model``, recorded
    through its hook points: ``hidden`` ``(n + 1, B, T, D)`` (layer 0, the embeddings, is
    ``blocks.0.hook_resid_pre``; layer ``k`` the output of block ``k``) and ``weights``
    ``(n, B, H, T, S)`` (every block's ``attn.hook_pattern``; None without ``maps``); no
    ``B`` axis for an unbatched sequence.
    ``model.layers`` are its blocks. The views of every model (``inspect``, ``analyze``,
    explain) come from here, so they show what the forward pass computed.
    """
    blocks = model.layers
    store: dict[str, np.ndarray] = {}

    def keep(x, name):  # these arrays are not updated in place later: np.stack copies them
        store[name] = x

    keep.reads_only = True

    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.{b.output_hook}" for i, b in enumerate(blocks)]
    pattern = [f"blocks.{i}.attn.hook_pattern" for i in range(len(blocks))] if maps else []
    with hooks(model, [(n, keep) for n in names + pattern]):
        out = run()
    xp = namespace(store[names[0]])  # a model moved to another library (Module.to) records in that library
    hidden = xp.stack([store[n] for n in names])
    weights = xp.stack([store[n] for n in pattern]) if maps else None
    if weights is not None and hidden.ndim == 3:  # one unbatched sequence: (n, H, T, S)
        weights = weights[:, 0]
    return out, hidden, weights
