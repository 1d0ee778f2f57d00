"""Named hook points: read or replace any activation of a model, one mechanism for all.

Every layer marks its activations with :class:`HookPoint`\\ s, identity modules that do
nothing until a hook is attached. A module's hook names are the dotted paths of its hook
points, in the order the forward pass reaches them, with the names TransformerLens uses
(``blocks.0.attn.hook_pattern``, ``blocks.3.hook_resid_post``, ``ln_final.hook_normalized``).
Blocks count from 0 here, as in TransformerLens; attnlab's *layer* numbers count the
embeddings as layer 0, so hook ``blocks.{k-1}.hook_resid_post`` is layer ``k``.

Three calls on every :class:`~attnlab.nn.Module` (a model, a block, one attention layer):

- ``module.run_with_cache(*args, names_filter=None, **kwargs) -> (output, cache)``: the
  output and an :class:`ActivationCache` of copies of the activations whose names pass the
  filter (memory grows only with what was asked for);
- ``module.run_with_hooks(*args, fwd_hooks=[(name or predicate, fn)], **kwargs)``: each
  ``fn(activation, name)`` returns None to read or an array of the same shape and dtype to
  replace the activation (patching, ablation);
- ``with module.hooks(fwd_hooks): ...``: the same around any code, ``generate`` included
  (hooks then run once per decoding step, on that step's tokens).

Hooks are removed when the call or the ``with`` block ends, also when it raises. A hook
receives the live activation: keep a copy if you keep it (``run_with_cache`` does).
With no hook attached a hook point costs one attribute test.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from attnlab._validation import fmt_shape
from attnlab.nn.module import Module

__all__ = ["ActivationCache", "HookPoint", "hook_points", "record_layers"]

HookFn = Callable[[np.ndarray, str], "np.ndarray | None"]


class HookPoint(Module):
    """An identity layer that marks an activation: ``hook(x)`` returns ``x``, or what the
    attached hook functions make of it.

    >>> hp = HookPoint()
    >>> hp(np.ones(2))
    array([1., 1.])
    """

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "_fns", ())

    def __call__(self, x):
        if not self._fns:
            return x
        for fn, name in self._fns:
            out = fn(x, name)
            if out is not None:
                x = _replacement(out, x, name)
        return x

    def forward(self, x):
        return self(x)

    def backward(self, grad_output):
        return grad_output

    def __repr__(self) -> str:
        return "HookPoint()"


def _replacement(out, x, name: str) -> np.ndarray:
    """A hook's returned array, checked against the activation it replaces, as a fresh
    array (the forward pass may update it in place)."""
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise TypeError(f"the hook on {name!r} returned {type(out).__name__}: a hook returns None "
                        f"(read only) or an array {fmt_shape(x.shape)} of dtype {x.dtype}")
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise ValueError(f"the hook on {name!r} returned an array {fmt_shape(tuple(out.shape))} of dtype "
                         f"{out.dtype}, but the activation is {fmt_shape(tuple(x.shape))} of dtype {x.dtype}")
    return np.array(out, copy=True) if isinstance(out, np.ndarray) else out


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


def _attach(module: Module, fwd_hooks) -> list[HookPoint]:
    """Attach ``fwd_hooks`` to ``module``'s hook points; returns the points touched."""
    points = dict(hook_points(module))
    known = list(points)
    if isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and callable(fwd_hooks[1]):
        fwd_hooks = [fwd_hooks]
    plan: dict[str, list] = {}
    for item in fwd_hooks:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError("fwd_hooks must be a list of (name or predicate, fn) pairs, got an item "
                            f"of type {type(item).__name__}")
        target, fn = item
        if not callable(fn):
            raise TypeError(f"the hook for {target!r} is {type(fn).__name__}, not a function fn(activation, name)")
        if isinstance(target, str):
            _check_known(target, known)
            plan.setdefault(target, []).append(fn)
        elif callable(target):
            for name in known:
                if target(name):
                    plan.setdefault(name, []).append(fn)
        else:
            raise TypeError(f"a hook's target must be a hook name or a predicate name -> bool, "
                            f"got {type(target).__name__}")
    touched = []
    for name, fns in plan.items():
        point = points[name]
        object.__setattr__(point, "_fns", point._fns + tuple((fn, name) for fn in fns))
        touched.append(point)
    return touched


@contextlib.contextmanager
def hooks(module: Module, fwd_hooks) -> Iterator[Module]:
    """Attach ``fwd_hooks`` for the ``with`` block; removed on exit, also on an error."""
    touched: list[HookPoint] = []
    try:
        touched = _attach(module, fwd_hooks)
        yield module
    finally:
        for point in touched:
            object.__setattr__(point, "_fns", ())


class ActivationCache(Mapping):
    """Activations recorded by :meth:`~attnlab.nn.Module.run_with_cache`: a read-only
    mapping from hook name to a NumPy array (a copy, not writeable), in forward order.

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


def _recorder(store: dict) -> HookFn:
    def record(x, name):
        a = np.array(x, copy=True)  # later in-place updates must not reach the cache
        a.flags.writeable = False
        store[name] = a

    return record


def run_with_cache(module: Module, *args, names_filter=None, **kwargs):
    """``(module(*args, **kwargs), cache)``: see :mod:`attnlab.nn.hooks`."""
    known = [name for name, _ in hook_points(module)]
    keep = _check_name_filter(names_filter, known)
    store: dict[str, np.ndarray] = {}
    wanted = [name for name in known if keep(name)]
    with hooks(module, [(name, _recorder(store)) for name in wanted]):
        out = module(*args, **kwargs)
    order = {name: i for i, name in enumerate(known)}
    return out, ActivationCache(dict(sorted(store.items(), key=lambda kv: order[kv[0]])))


def run_with_hooks(module: Module, *args, fwd_hooks=(), **kwargs):
    """``module(*args, **kwargs)`` with ``fwd_hooks`` attached for the call."""
    with hooks(module, fwd_hooks):
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

    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.{b.output_hook}" for i, b in enumerate(blocks)]
    pattern = [f"blocks.{i}.attn.hook_pattern" for i in range(len(blocks))] if maps else []
    with hooks(model, [(n, keep) for n in names + pattern]):
        out = run()
    hidden = np.stack([store[n] for n in names])
    weights = np.stack([store[n] for n in pattern]) if maps else None
    if weights is not None and hidden.ndim == 3:  # one unbatched sequence: (n, H, T, S)
        weights = weights[:, 0]
    return out, hidden, weights
