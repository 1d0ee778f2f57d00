"""``Module`` and ``Parameter``: parameters, modes, state dicts and gradients.

The backward mechanism: a module called in training mode keeps what its backward pass
needs on the call's tape (:mod:`attnlab.nn._context`: per thread, not on the module, so two
threads can train one model and a module may be called twice in one forward pass);
``module.backward(grad_output)`` takes it back, returns the gradients of its inputs and
**adds** each parameter's gradient to ``param.grad``. Composite modules call their
children's ``backward`` in reverse order, so each piece of math is written once. One
backward per forward: the backward pass frees what the forward pass kept.

The array library: parameters are NumPy arrays until :meth:`Module.to` converts them, once,
to another Array API library (torch, CuPy, JAX, ``array_api_strict``) or device; the
forward passes then compute in that library through the core's namespace path
(:mod:`attnlab.core._namespace`). The backward passes are NumPy-only.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from attnlab._validation import fmt_shape
from attnlab.core._namespace import array_type, is_numpy, namespace, to_host
from attnlab.core._namespace import device as device_of
from attnlab.nn import _context
from attnlab.quant import is_quantized

# Gradients of one parameter may be added by two threads' backward passes at once.
_GRAD_LOCK = threading.Lock()
# Counts the changes of any module's children or parameters (assigned, replaced, removed) and
# of any parameter's array (``param.data = ...``): what a plan gathered from a model's modules
# compares to know it is still current.
_structure = [0]


def structure_version() -> int:
    """A number that changes whenever a module anywhere gains, loses or replaces a child
    module or a parameter (adapters added, a layer swapped), a parameter's array is
    replaced (``param.data = ...``; changes in place keep the array), or a module's public
    attribute is given another value (a setting or a slot: ``attn.attention_fn = f``): plans
    built from a model's modules (the compiled decoding step's) are rebuilt when it moved.
    (Modules keep what a forward pass leaves behind in private attributes, which do not
    count.)"""
    return _structure[0]


_UNSET = object()
_hooks_now = _context.current_hooks


class Parameter:
    """A trainable array: ``data`` (updated in place by optimizers) and its ``grad``.

    ``requires_grad`` (True by default, as in torch) says whether backward passes compute
    its gradient: a frozen parameter (``requires_grad=False``, :meth:`Module.requires_grad_`)
    keeps ``grad`` None, and the layers skip the products that would make it (a frozen
    weight's gradient is never computed, and an input kept only for it is not kept).
    ``np.asarray(param)`` gives ``param.data``.

    >>> p = Parameter(np.zeros(2), requires_grad=False)
    >>> p.accumulate(np.ones(2)); p.grad is None
    True
    """

    __slots__ = ("data", "grad", "requires_grad")

    def __setattr__(self, name: str, value) -> None:
        if name == "data":  # a new array: plans that read the old one are out of date
            _structure[0] += 1
        object.__setattr__(self, name, value)

    def __init__(self, data: np.ndarray, requires_grad: bool = True):
        self.data = np.asarray(data)
        self.grad: np.ndarray | None = None
        self.requires_grad = bool(requires_grad)

    def requires_grad_(self, requires_grad: bool = True) -> Parameter:
        """Freeze (False) or unfreeze (True) this parameter; returns it (torch's name)."""
        self.requires_grad = bool(requires_grad)
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def accumulate(self, grad: np.ndarray, *, owned: bool = False) -> None:
        """Add ``grad`` to ``self.grad`` (creating it on first use).

        ``owned``: ``grad`` is a fresh array that nothing else holds or will change (a
        layer's newly computed gradient); on first use it becomes ``self.grad`` itself
        rather than a copy, as torch's autograd keeps a fresh gradient (a weight matrix's
        copy costs as much as a pass over it). Nothing is added for a ``grad`` of None, to a
        frozen parameter, or in a context with frozen parameters
        (:func:`attnlab.nn._context.frozen_parameters`)."""
        if grad is None or not self.requires_grad or _context.parameters_frozen():
            return
        with _GRAD_LOCK:
            if self.grad is None:
                if owned and type(grad) is np.ndarray and grad.base is None and grad.dtype == self.data.dtype \
                        and grad.shape == self.data.shape and grad.flags.writeable:
                    self.grad = grad
                else:
                    self.grad = np.array(grad, dtype=self.data.dtype, copy=True)
            else:
                self.grad += grad

    def add_rows(self, rows: np.ndarray, grad: np.ndarray) -> None:
        """Add ``grad`` ``(N, ...)`` to the rows ``rows`` ``(N,)`` of ``self.grad`` (made of
        zeros on first use; a row named twice gets both): an embedding table's gradient
        without a second table-sized array. A frozen parameter ignores it, as does a context
        with frozen parameters."""
        if not self.requires_grad or _context.parameters_frozen():
            return
        with _GRAD_LOCK:
            if self.grad is None:
                self.grad = np.zeros(self.data.shape, dtype=self.data.dtype)
            np.add.at(self.grad, rows, grad)

    def __array__(self, dtype=None, copy=None):
        data = to_host(self.data)
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        frozen = "" if self.requires_grad else ", requires_grad=False"
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype}{frozen})"


# What the layers' forward passes call in another library's namespace beyond the core's own
# needs (which attnlab.core._namespace checks): checked once, when Module.to picks the library.
LAYER_FUNCTIONS = (
    "abs", "concat", "finfo", "full", "full_like", "mean", "permute_dims", "sign", "sqrt", "take", "tanh",
)


def _layer_namespace(like):
    """The namespace of the array ``like``, checked for everything the layers call."""
    xp = namespace(like, names=("target",))
    missing = [name for name in LAYER_FUNCTIONS if xp is not np and not hasattr(xp, name)]
    if missing:
        raise TypeError(
            f"attnlab's layers cannot compute on {array_type(like)} arrays: their namespace "
            f"{getattr(xp, '__name__', xp)!r} lacks {', '.join(missing)} (Array API standard 2022.12)"
        )
    return xp


def _library(target) -> object:
    """The namespace an array library's module computes in (``np`` for NumPy), found through
    one small array it makes; a clear error for anything else."""
    if target is np or getattr(target, "__name__", "") in ("numpy", "array_api_compat.numpy"):
        return np
    make = getattr(target, "asarray", None)
    if make is None:
        raise TypeError(f"{target.__name__} is not an array library (it has no asarray)")
    return _layer_namespace(make(0.0))


class Module:
    """Base class of attnlab's layers (PyTorch's ``nn.Module`` names and semantics).

    Subclasses assign ``Parameter``s and child ``Module``s as attributes (registered in
    assignment order), implement ``forward`` and, to be trainable, ``backward``.
    Modules start in training mode, as in PyTorch.
    """

    # The array type of the weights after ``to()`` moved them out of NumPy (None: NumPy).
    _array_type: str | None = None

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value) -> None:
        params, modules = self.__dict__.get("_parameters"), self.__dict__.get("_modules")
        if params is None:
            raise RuntimeError(f"call Module.__init__() in {type(self).__name__}.__init__ first")
        if name in params or name in modules or isinstance(value, Parameter | Module) \
                or not name.startswith("_") and self.__dict__.get(name, _UNSET) is not value:
            _structure[0] += 1  # a public attribute is a setting or a slot (attention_fn): plans read it
        params.pop(name, None)
        modules.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        if not self.training:
            h = _hooks_now()
            if h is None or not h.keep:  # inference: nothing to keep (the hot path: one read)
                return self.forward(*args, **kwargs)
        tape = _context.tape()  # a top-level call starts a new generation of the tape
        if not tape.depth:
            tape.generation += 1
        tape.depth += 1
        try:
            return self.forward(*args, **kwargs)
        finally:
            tape.depth -= 1

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def backward(self, grad_output):
        raise NotImplementedError(f"{type(self).__name__} has no backward pass")

    # ---- parameters and state -------------------------------------------------------
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """``(name, Parameter)`` pairs, with the names ``state_dict()`` uses."""
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p
        for name, m in self._modules.items():
            yield from m.named_parameters(prefix + name + ".")

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix.rstrip("."), self
        for name, m in self._modules.items():
            yield from m.named_modules(prefix + name + ".")

    def state_dict(self) -> dict[str, np.ndarray]:
        """A NumPy copy of every parameter, keyed by torch-style dotted names (weights of
        another library, see :meth:`to`, are copied to the host; a weight kept quantized is a
        copy of its :class:`~attnlab.quant.QuantizedTensor`, which :meth:`load_state_dict`
        takes back as it is)."""
        return {name: p.data.copy() if is_quantized(p.data) else to_host(p.data).copy()
                for name, p in self.named_parameters()}

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).

        ``assign=True`` (as in torch) makes writeable C-contiguous NumPy arrays of the
        parameter's dtype the parameters themselves, without a copy: for arrays nothing
        else holds, such as those a loader has just read (others are still copied).

        Raises:
            KeyError: a missing or unexpected key (only missing ones if ``strict=False``
                ignores extras), listing all of them.
            ValueError: an array whose shape differs; names the tensor and both shapes.
            TypeError: a non-float array.
        """
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if missing or (strict and unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if strict and unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise KeyError(f"{type(self).__name__}.load_state_dict: " + "; ".join(parts))
        staged = {}
        for name, p in own.items():
            arr = state_dict[name]
            if is_quantized(arr):  # kept as it is (inference only): its shape must fit
                if tuple(arr.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {name!r} has shape {fmt_shape(arr.shape)} in the state dict, "
                                     f"but the model needs {fmt_shape(p.shape)}")
                staged[name] = arr
                continue
            arr = np.asarray(arr.detach().cpu().numpy() if hasattr(arr, "detach") else arr)
            if not np.issubdtype(arr.dtype, np.floating):
                raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, but should be floating-point")
            if arr.shape != p.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {fmt_shape(arr.shape)} in the state dict, "
                    f"but the model needs {fmt_shape(p.shape)}"
                )
            staged[name] = arr
        for name, arr in staged.items():  # all checked first: nothing is half-loaded
            p = own[name]
            if is_quantized(arr):
                p.data = arr
            elif isinstance(p.data, np.ndarray):
                if assign and arr.dtype == p.data.dtype and arr.flags.writeable and arr.flags.c_contiguous:
                    p.data = arr
                else:
                    p.data[...] = arr
            else:  # weights of another library: a new array there, on their device
                xp = namespace(p.data)
                p.data = xp.astype(xp.asarray(arr, device=device_of(p.data), copy=True), p.data.dtype)

    # ---- the array library ---------------------------------------------------------------
    def to(self, target=None, *, device=None) -> Module:
        """Convert every parameter, once and in place, to another array library or device;
        returns ``self`` (as ``torch.nn.Module.to``).

        After ``layer.to(torch)`` the forward pass takes torch tensors and returns torch
        tensors of the weights' dtype, computed in torch through the core's namespace path;
        ``layer.to(np)`` brings the weights back. Inputs must then come from the weights'
        library and device (integer ids may be NumPy: they are moved; a model's ``input_ids``
        and ``attention_mask`` may be of either library).

        A moved module runs forward passes only. It keeps nothing for a backward pass (in
        training mode too, where dropout still drops), and its ``backward``, as
        ``run_with_cache(incl_bwd=True)``, raises a ``TypeError`` that says to call
        ``.to(np)`` first (or to train in torch: :func:`attnlab.interop.to_torch`). Weights
        kept quantized cannot move: ``to`` refuses them before anything moves.

        Args:
            target: where the weights go:

                - an array library's module: ``np`` (back to NumPy), ``torch``, ``cupy``,
                  ``jax.numpy``, ``array_api_strict``, ... (its namespace comes from
                  ``array_api_compat``, the ``arrayapi`` extra);
                - an array: its library and its device (``layer.to(x)``);
                - a device (``"cpu"``, ``"cuda:1"``, a ``torch.device``, ...): the same
                  library, on that device.
            device: the device within the library ``target`` names (default: the
                library's default device; for an array ``target``, that array's device).

        Dtypes are kept. Weights that move lose their ``.grad``. :meth:`state_dict` still
        returns NumPy arrays (copied to the host), so checkpoints read and write as before.

        Raises:
            TypeError: a ``target`` that is none of the above, a library whose namespace
                lacks a function attnlab computes with (the message names the array type),
                or weights kept quantized (named; load the model dequantized).
            ValueError: a NumPy layer sent to a device other than ``"cpu"``.

        >>> import numpy as np, torch
        >>> from attnlab.nn import Linear
        >>> layer = Linear(3, 2, rng=np.random.default_rng(0)).to(torch)
        >>> layer(torch.ones(4, 3)).dtype
        torch.float32
        >>> type(layer.to(np).weight.data).__name__
        'ndarray'
        """
        if isinstance(target, types.ModuleType):
            xp, dev = _library(target), device
        elif hasattr(target, "shape") and hasattr(target, "dtype"):  # an array: its library and device
            if device is not None:
                raise TypeError("pass device= with a library, not with an array (it brings its own device)")
            xp, dev = _layer_namespace(target), device_of(target)
        else:  # a device: the library the weights are in now
            if target is not None and device is not None:
                raise TypeError(f"pass one device: target={target!r} or device={device!r}")
            held: list = []
            for _, m in self.named_modules():
                m._apply(lambda a: held.append(a) or a)
            if not held:
                return self  # no weights (an activation): nothing to move
            xp, dev = namespace(held[0]), device if target is None else target
        if xp is np and dev is not None and str(dev) != "cpu":
            raise ValueError(
                f"NumPy arrays live on the host, not on device {dev!r}: name the library too, "
                f"e.g. layer.to(torch, device={str(dev)!r})"
            )
        kind = None if xp is np else array_type(xp.empty(0))  # what backward refuses
        if kind is not None:
            self._check_movable(kind)
        convert = _converter(xp, dev)
        for _, m in self.named_modules():
            m._apply(convert)
            object.__setattr__(m, "_array_type", kind)
        return self

    def _check_movable(self, kind: str) -> None:
        """A ``TypeError`` before anything moves when a weight cannot go to another library:
        a weight kept quantized, which only attnlab's NumPy kernels multiply by."""
        quantized = [(name, p.data.kind) for name, p in self.named_parameters() if is_quantized(p.data)]
        if quantized:
            (name, q), more = quantized[0], len(quantized) - 1
            others = f" and {more} more weights" if more else ""
            raise TypeError(
                f"{type(self).__name__}.to(): {name}{others} are kept quantized ({q}), and quantized weights "
                f"compute only in attnlab's NumPy kernels, not on {kind}: load the model dequantized "
                "(load_smollm2() or from_pretrained(path) without quantized=True), then move it")

    def _apply(self, convert: Callable) -> None:
        """Replace this module's own arrays by ``convert(array)`` (the parameters; a
        subclass holding other arrays converts them too)."""
        for p in self._parameters.values():
            if p is None:
                continue
            new = convert(p.data)
            if new is not p.data:
                p.data, p.grad = new, None

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Freeze (``False``) or unfreeze every parameter of this module and its children;
        returns ``self`` (torch's ``Module.requires_grad_``). Backward passes then skip the
        frozen parameters' gradients (see :class:`Parameter`); the input gradients still
        flow through them.

        >>> from attnlab.nn import Linear
        >>> layer = Linear(3, 2).requires_grad_(False)
        >>> [p.requires_grad for p in layer.parameters()]
        [False, False]
        """
        for p in self.parameters():
            p.requires_grad = bool(requires_grad)
        return self

    # ---- modes ------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Training mode (``mode=True``): forward passes keep what :meth:`backward` needs (and
        dropout drops). ``train(False)`` (:meth:`eval`) also frees what this thread's forward
        passes kept for these modules. The mode is the modules' state, shared by every
        thread: set it before threads start."""
        tape = None if mode else _context.existing_tape()
        for _, m in self.named_modules():
            object.__setattr__(m, "training", bool(mode))
            if tape is not None:
                tape.drop(m)
        return self

    def eval(self) -> Module:
        return self.train(False)

    # ---- what backward reads: the call's tape (attnlab.nn._context) --------------------
    def _keeping(self) -> bool:
        """Whether this call keeps what backward needs: training mode, or a call that keeps
        its tape in any mode (``run_with_cache(incl_bwd=True)``). Eval-mode shortcuts that
        overwrite inputs or skip intermediates check this. A module whose weights
        :meth:`to` moved to another library keeps nothing (its backward passes refuse)."""
        if self._array_type is not None:
            return False
        if self.training:
            return True
        h = _hooks_now()
        return h is not None and h.keep

    def _save(self, **cache) -> None:
        if self._keeping():
            _context.tape().push(self, cache)

    def _missing(self) -> str:
        name = type(self).__name__
        return (f"{name}.backward() needs a forward call in training mode first: call .train() before the "
                "forward pass (eval mode, the default after loading, keeps nothing for backward)")

    def _freed(self) -> str:
        name = type(self).__name__
        return (f"{name}.backward() already ran for the last forward pass, which freed what that pass kept: "
                "run the forward pass again (one backward per forward)")

    def _save_call(self, **record) -> None:
        """What a model's :meth:`backward` reads of its forward pass (see
        :meth:`_start_backward`), with the backward hooks attached around that pass. In a
        call that keeps nothing (eval mode) what an earlier call kept is forgotten, so a
        backward after it says so instead of reading stale arrays."""
        if self._keeping():
            h = _context.current_hooks()
            self._save(bwd_hooks=h.bwd if h is not None else {}, **record)
        else:
            tape = _context.existing_tape()
            if tape is not None:
                tape.drop(self)

    def _start_backward(self, grad_output, name: str = "grad_out") -> tuple[dict, np.ndarray]:
        """``(record, grad)`` for a model's backward pass, checked in this order, before
        anything is freed: float (not quantized) NumPy weights; a forward pass that kept its
        record (training mode, not freed by an earlier backward, no key/value cache
        (``record["cached"]``)); ``grad_output`` of the
        output's shape (``record["shape"]``) and the weights' dtype; no backward hooks
        attached now that were not attached around the forward pass."""
        if self._array_type is not None:
            raise TypeError(f"{type(self).__name__}.backward() runs on NumPy arrays only, but its weights are "
                            f"{self._array_type}: call .to(np) before training with attnlab, or train in torch "
                            "(attnlab.interop.to_torch)")
        for pname, p in self.named_parameters():
            if is_quantized(p.data):
                raise TypeError(
                    f"{type(self).__name__}.backward(): {pname} is kept quantized ({p.data.kind}), and there is no "
                    "backward pass through quantized weights: load the model dequantized (load_smollm2() or "
                    "from_pretrained(path) without quantized=True; dtype=np.float64 for float64)")
        tape = _context.tape()
        record = tape.peek(self, missing=self._missing(), freed=self._freed())
        if record.get("cached"):
            raise RuntimeError(f"{type(self).__name__} has no backward pass through a call with a key/value cache: "
                               "run the whole sequence without cache= to train")
        g = grad_output
        if not isinstance(g, np.ndarray):
            if not is_numpy(g):
                raise TypeError(f"{name} is {array_type(g)}, but backward runs on NumPy arrays")
            g = np.asarray(g)
        shape, dtype = tuple(record["shape"]), self._dtype_of_params()
        if g.shape != shape:
            raise ValueError(f"{name} has shape {fmt_shape(g.shape)}, but should be {fmt_shape(shape)}: the "
                             "shape of the output of the last forward pass")
        if g.dtype != dtype:
            raise TypeError(f"{name} has dtype {g.dtype}, but should be {dtype}, the output's dtype (cast it: "
                            f"{name}.astype(np.{dtype}))")
        now = _context.current_hooks()
        if now is not None and now.bwd:
            kept = record["bwd_hooks"]
            if any(kept.get(point) != fns for point, fns in now.bwd.items()):
                names = sorted({name for fns in now.bwd.values() for _, name in fns})
                raise ValueError(f"backward hooks on {', '.join(names)} are attached around backward() but were "
                                 "not around the forward pass: a backward pass runs the hooks of its forward pass; "
                                 "attach them around both (with model.hooks(bwd_hooks=...): forward, backward)")
        return tape.pop(self, missing=self._missing(), freed=self._freed()), g

    def _dtype_of_params(self) -> np.dtype:
        for p in self.parameters():
            return np.dtype(p.data.dtype)
        return np.dtype(np.float32)

    def _saved(self) -> dict:
        cache = {} if self._array_type is not None else \
            _context.tape().pop(self, missing=self._missing(), freed=self._freed())
        if self._array_type is not None or not is_numpy(*cache.values()):
            kind = self._array_type or next(array_type(v) for v in cache.values() if not is_numpy(v))
            raise TypeError(
                f"{type(self).__name__}.backward() runs on NumPy arrays only, but its forward pass "
                f"ran on {kind}: call .to(np) before training with attnlab, or train in torch "
                "(attnlab.interop.to_torch)"
            )
        return cache

    # ---- hook points (see attnlab.nn.hooks) ---------------------------------------------
    def hook_names(self) -> list[str]:
        """The names of this module's hook points, in the order the forward pass reaches
        them (TransformerLens's names; blocks count from 0). See :mod:`attnlab.nn.hooks`."""
        from attnlab.nn.hooks import hook_points

        return [name for name, _ in hook_points(self)]

    def hooks(self, fwd_hooks=(), bwd_hooks=()):
        """A context manager that attaches ``fwd_hooks`` (a list of ``(name or predicate,
        fn)``, ``fn(activation, name) -> None | array``) and ``bwd_hooks`` (``fn(grad,
        name) -> None | array``, run by :meth:`backward` after a forward pass inside the
        block) for its ``with`` block, around any call (``generate`` included: the hooks
        run once per step), in this thread (context) only. Removed on exit, also on an
        error. See :mod:`attnlab.nn.hooks`."""
        from attnlab.nn.hooks import hooks

        return hooks(self, fwd_hooks, bwd_hooks)

    def run_with_cache(self, *args, names_filter=None, incl_bwd: bool = False, grad_out=None, **kwargs):
        """``(output, cache)``: the forward pass on ``args``/``kwargs`` and an
        :class:`~attnlab.nn.hooks.ActivationCache` of the activations whose names pass
        ``names_filter`` (None: all; a name; a list of names; a predicate ``name -> bool``).
        With ``incl_bwd=True`` the call also runs ``backward(grad_out)`` and caches each
        activation's gradient under ``name + "_grad"`` (as TransformerLens; see
        :func:`attnlab.nn.hooks.run_with_cache`).

        >>> from attnlab.nn import LayerNorm
        >>> _, cache = LayerNorm(3).run_with_cache(np.array([[1.0, 2.0, 3.0]], dtype=np.float32))
        >>> list(cache), cache["hook_normalized"].round(2)
        (['hook_normalized'], array([[-1.22,  0.  ,  1.22]], dtype=float32))
        """
        from attnlab.nn.hooks import run_with_cache

        return run_with_cache(self, *args, names_filter=names_filter, incl_bwd=incl_bwd, grad_out=grad_out,
                              **kwargs)

    def run_with_hooks(self, *args, fwd_hooks=(), bwd_hooks=(), **kwargs):
        """The forward pass on ``args``/``kwargs`` with ``fwd_hooks`` attached for the
        call: each ``fn(activation, name)`` returns None (read) or an array of the same
        shape and dtype that replaces the activation. ``bwd_hooks`` (``fn(grad, name)``)
        belong to this call too: a :meth:`backward` after it runs them.

        >>> from attnlab.nn import LayerNorm
        >>> zero = lambda x, name: np.zeros_like(x)
        >>> x = np.array([[1.0, 3.0]], dtype=np.float32)
        >>> LayerNorm(2).run_with_hooks(x, fwd_hooks=[("hook_normalized", zero)])
        array([[0., 0.]], dtype=float32)
        """
        from attnlab.nn.hooks import run_with_hooks

        return run_with_hooks(self, *args, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            if type(m).__name__ == "HookPoint":  # markers, not layers
                continue
            lines.append(f"  ({name}): " + repr(m).replace("\n", "\n  "))
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"


def _converter(xp, dev) -> Callable:
    """``array -> array`` in namespace ``xp`` on device ``dev`` (``None``: the library's
    default, or where the array already is in that library); unchanged if already there."""
    if xp is np:  # weights kept quantized are NumPy's already
        return lambda a: a if is_quantized(a) else to_host(a)

    def convert(a):
        if not isinstance(a, np.ndarray) and namespace(a) is xp:
            if dev is None or device_of(a) == dev:
                return a
            import array_api_compat

            return array_api_compat.to_device(a, dev)
        return xp.asarray(to_host(a), device=dev, copy=True)

    return convert
