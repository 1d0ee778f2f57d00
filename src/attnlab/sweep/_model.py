"""The model of a sweep: loaded once in the driver, rebuilt in each worker around weights that
every worker shares.

A worker gets a :class:`Recipe`: the model's class, its config and dtype, and where its
weights are. It builds the layers without drawing weights (``init.empty_weights``) and
adopts the shared arrays as its parameters, read-only: a safetensors file written once and
memory-mapped by every worker (the ``processes`` engine: the OS keeps one copy in its page
cache), or Ray's object store (one copy per machine, mapped by every actor there).

A weight kept quantized (:class:`attnlab.quant.QuantizedTensor`, e.g. a ``.gguf`` loaded with
``quantized=True``) travels as it is: its codes, scales and mins are three tensors of the
file (``name:codes``, ``name:scales``, ``name:mins``), and the recipe names its type and what
its products multiply (:attr:`Recipe.quantized`), so a worker's model computes what the
driver's does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Recipe", "adopt", "fingerprint", "load_model", "map_weights", "model_identity", "recipe_for"]


def load_model(model):
    """``model`` itself, or the model a name or path gives: ``"smollm2"`` (the bundled
    SmolLM2-135M-Instruct), a model folder, a ``.gguf`` file or an attnlab checkpoint."""
    if isinstance(model, str | os.PathLike):
        if str(model).lower() == "smollm2":
            from attnlab.models.llama import load_smollm2

            return load_smollm2()
        from attnlab.models.registry import from_pretrained

        return from_pretrained(model)
    if not hasattr(model, "run_with_cache") or not hasattr(model, "named_parameters"):
        raise TypeError(f"model must be an attnlab model, 'smollm2' or a model path, got {type(model).__name__}")
    return model


def fingerprint(model) -> str:
    """A short digest of the model's parameters: names, shapes, dtypes and a strided sample of
    every array's values (cheap for any size, and different for any other checkpoint); a
    quantized weight by its type, what its products multiply and its codes, scales and mins."""
    from attnlab.quant import is_quantized

    h = hashlib.blake2b(digest_size=12)
    for name, p in model.named_parameters():
        w = p.data
        if is_quantized(w):
            h.update(f"{name}{w.shape}{w.kind}{w.activations}".encode())
            parts = _quantized_parts(w)
        else:
            parts = {"": np.asarray(w)}
        for label, a in parts.items():
            h.update(f"{name}{label}{a.shape}{a.dtype}".encode())
            flat = a.reshape(-1)
            h.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).tobytes())
    return h.hexdigest()


def _quantized_parts(w) -> dict[str, np.ndarray]:
    """A quantized weight's arrays by the suffix their tensors get in the shared file."""
    parts = {":codes": w.codes, ":scales": w.scales}
    if w.mins is not None:
        parts[":mins"] = w.mins
    return parts


def _describe(model) -> tuple[dict, dict]:
    """``(names, quantized)`` of a :class:`Recipe`: every parameter's ``(shape, dtype)`` (a
    quantized weight's products are float32), and each quantized one's ``(kind, shape,
    activations)``."""
    from attnlab.quant import is_quantized

    names, quantized = {}, {}
    for n, p in model.named_parameters():
        names[n] = (tuple(p.shape), str(_dtype(p.data)))
        if is_quantized(p.data):
            quantized[n] = (p.data.kind, tuple(p.data.shape), p.data.activations)
    return names, quantized


def _dtype(w) -> np.dtype:
    """The dtype of a parameter's array (a quantized weight's: float32, its products')."""
    from attnlab.quant import is_quantized

    return w.dtype if is_quantized(w) else np.asarray(w).dtype


def model_identity(model) -> dict:
    """What a sweep's folder records about the model (and compares when resuming)."""
    config = getattr(model, "config", None)
    as_dict = getattr(config, "to_dict", None)
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "name": str(getattr(model, "name", "")),
        "config": _jsonable(as_dict() if callable(as_dict) else dataclasses.asdict(config)
                            if dataclasses.is_dataclass(config) else repr(config)),
        "weights": fingerprint(model),
    }


def _jsonable(x: Any):
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return repr(x)


@dataclasses.dataclass
class Recipe:
    """How a worker rebuilds the driver's model (picklable: classes, a config, paths).

    Attributes:
        cls: the model class.
        config: its config object.
        kwargs: the other constructor arguments: ``dtype``, and those the model holds as
            attributes (its tokenizer, chat template, name; an encoder's pooling), so that a
            worker's model decodes and embeds as the driver's does.
        names: parameter name -> ``(shape, dtype)``, checked against the rebuilt model.
        path: the safetensors file to map (``processes``), or None.
        arrays: the arrays themselves (Ray: read-only views of its object store; a quantized
            weight as its :class:`~attnlab.quant.QuantizedTensor`), or None.
        quantized: parameter name -> ``(kind, shape, activations)`` of each weight kept quantized.
    """

    cls: type
    config: Any
    kwargs: dict
    names: dict
    path: str | None = None
    arrays: Any = None
    quantized: dict = dataclasses.field(default_factory=dict)

    def build(self):
        """The model, its parameters the shared arrays (read-only)."""
        from attnlab.nn import init

        with init.empty_weights():
            model = self.cls(self.config, **self.kwargs)
        arrays = self.arrays if self.arrays is not None else map_weights(self.path, self.quantized)
        adopt(model, arrays, self.names)
        return model


# Constructor arguments a recipe does not take from the model's attributes: the config and
# dtype (given apart), the weights (shared), the generator (no weights are drawn) and the
# attention function (read from the layers, which hold it).
_NOT_CARRIED = frozenset({"config", "weights", "rng", "dtype", "attention_fn"})


def recipe_for(model, folder: str | os.PathLike | None = None) -> Recipe:
    """A :class:`Recipe` for ``model``; with ``folder``, its weights are written there once as
    one safetensors file (``weights-<fingerprint>.safetensors``) that workers map.

    Raises:
        TypeError: a model that its class and config cannot rebuild (the parameters differ).
    """
    cls, config = type(model), getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{cls.__name__} has no config: the processes and ray engines rebuild a model from "
                        "its class and config; run it with engine='serial'")
    params = inspect.signature(cls).parameters
    kwargs = {"dtype": _dtype(next(model.parameters()).data)} if "dtype" in params else {}
    for attr in params:  # what a loaded model holds beside its weights: its tokenizer, chat template, ...
        if attr not in _NOT_CARRIED and getattr(model, attr, None) is not None:
            kwargs[attr] = getattr(model, attr)
    if "attention_fn" in params:
        from attnlab.core.dispatch import scaled_dot_product_attention

        fns = {id(m.attention_fn): m.attention_fn for _, m in model.named_modules() if hasattr(m, "attention_fn")}
        if len(fns) > 1:
            raise TypeError(f"this {cls.__name__}'s layers use {len(fns)} different attention functions: the "
                            "processes and ray engines rebuild a model with one; run it with engine='serial'")
        fn = next(iter(fns.values()), None)
        if fn is not None and fn is not scaled_dot_product_attention:
            kwargs["attention_fn"] = fn  # a module-level function: pickled by name
    names, quantized = _describe(model)
    recipe = Recipe(cls, config, kwargs, names, quantized=quantized)
    _check_rebuild(recipe)
    if folder is not None:
        recipe.path = str(write_weights(model, folder))
    return recipe


def _check_rebuild(recipe: Recipe) -> None:
    from attnlab.nn import init

    with init.empty_weights():
        probe = recipe.cls(recipe.config, **recipe.kwargs)
    got, _ = _describe(probe)
    if got != recipe.names:
        diff = sorted(set(got.items()) ^ set(recipe.names.items()))[:3]
        raise TypeError(f"{recipe.cls.__name__}({type(recipe.config).__name__}) builds other parameters than "
                        f"this model has ({diff}): the processes and ray engines rebuild a model from its "
                        "class and config; run it with engine='serial'")


def write_weights(model, folder: str | os.PathLike) -> Path:
    """The model's parameters as one uncompressed safetensors file in ``folder`` (written
    atomically; an existing file of the same fingerprint is kept). A quantized weight is
    written as its codes, scales and mins (see the module docstring)."""
    from attnlab.io.safetensors import save_tensors
    from attnlab.quant import is_quantized

    path = Path(folder) / f"weights-{fingerprint(model)}.safetensors"
    if not path.is_file():
        tensors = {}
        for n, p in model.named_parameters():
            if is_quantized(p.data):
                tensors.update({n + label: a for label, a in _quantized_parts(p.data).items()})
            else:
                tensors[n] = np.asarray(p.data)
        save_tensors(path, tensors)
    return path


def map_weights(path: str, quantized: Mapping[str, tuple] | None = None) -> dict:
    """Every tensor of a safetensors file as a read-only memory map (no bytes read yet); the
    weights named in ``quantized`` (name -> ``(kind, shape, activations)``, :attr:`Recipe.quantized`)
    as a :class:`~attnlab.quant.QuantizedTensor` over their mapped codes, scales and mins."""
    from attnlab.io.safetensors import DTYPES, read_header

    infos, _ = read_header(path)
    out = {}
    for name, info in infos.items():
        if info.end == info.begin:
            out[name] = np.zeros(info.shape, DTYPES[info.dtype])
            continue
        out[name] = np.memmap(path, dtype=DTYPES[info.dtype], mode="r", offset=info.begin, shape=info.shape)
    for name, (kind, shape, activations) in (quantized or {}).items():
        from attnlab.quant import QuantizedTensor

        parts = {label: out.pop(name + label, None) for label in (":codes", ":scales", ":mins")}
        if parts[":codes"] is None or parts[":scales"] is None:
            raise ValueError(f"the shared weights do not hold the quantized parameter {name!r}")
        codes, scales, mins = (None if a is None else a.view(np.ndarray) for a in parts.values())
        out[name] = QuantizedTensor(kind, shape, codes, scales, mins, name=name, activations=activations)
    return out


def adopt(model, arrays: Mapping[str, np.ndarray], names: Mapping[str, tuple] | None = None) -> None:
    """Make ``arrays`` the model's parameters as they are (no copy, read-only stays
    read-only), after checking every name, shape and dtype."""
    own = dict(model.named_parameters())
    for name, p in own.items():
        a = arrays.get(name)
        if a is None or tuple(a.shape) != tuple(p.shape) or (names and str(_dtype(a)) != names[name][1]):
            raise ValueError(f"the shared weights do not fit the model's parameter {name!r}")
    for name, p in own.items():
        p.data = arrays[name].view(np.ndarray) if isinstance(arrays[name], np.memmap) else arrays[name]
