"""The model of a sweep: loaded once in the driver, rebuilt in each worker around weights that
every worker shares.

A worker gets a :class:`Recipe`: the model's class, its config and dtype, and where its
weights are. It builds the layers without drawing weights (``init.empty_weights``) and
adopts the shared arrays as its parameters, read-only: a float32 safetensors file written
once and memory-mapped by every worker (the ``processes`` engine: the OS keeps one copy in
its page cache), or Ray's object store (one copy per machine, mapped by every actor there).
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
    every array's values (cheap for any size, and different for any other checkpoint)."""
    h = hashlib.blake2b(digest_size=12)
    for name, p in model.named_parameters():
        a = np.asarray(p.data)
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        flat = a.reshape(-1)
        h.update(np.ascontiguousarray(flat[:: max(1, flat.size // 4096)]).tobytes())
    return h.hexdigest()


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
        kwargs: the other constructor arguments (``dtype``).
        names: parameter name -> ``(shape, dtype)``, checked against the rebuilt model.
        path: the float32 safetensors file to map (``processes``), or None.
        arrays: the arrays themselves (Ray: read-only views of its object store), or None.
    """

    cls: type
    config: Any
    kwargs: dict
    names: dict
    path: str | None = None
    arrays: Any = None

    def build(self):
        """The model, its parameters the shared arrays (read-only)."""
        from attnlab.nn import init

        with init.empty_weights():
            model = self.cls(self.config, **self.kwargs)
        arrays = self.arrays if self.arrays is not None else map_weights(self.path)
        adopt(model, arrays, self.names)
        return model


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
    kwargs = {"dtype": np.asarray(next(model.parameters()).data).dtype} if "dtype" in params else {}
    names = {n: (tuple(p.shape), str(np.asarray(p.data).dtype)) for n, p in model.named_parameters()}
    recipe = Recipe(cls, config, kwargs, names)
    _check_rebuild(recipe)
    if folder is not None:
        recipe.path = str(write_weights(model, folder))
    return recipe


def _check_rebuild(recipe: Recipe) -> None:
    from attnlab.nn import init

    with init.empty_weights():
        probe = recipe.cls(recipe.config, **recipe.kwargs)
    got = {n: (tuple(p.shape), str(np.asarray(p.data).dtype)) for n, p in probe.named_parameters()}
    if got != recipe.names:
        diff = sorted(set(got.items()) ^ set(recipe.names.items()))[:3]
        raise TypeError(f"{recipe.cls.__name__}({type(recipe.config).__name__}) builds other parameters than "
                        f"this model has ({diff}): the processes and ray engines rebuild a model from its "
                        "class and config; run it with engine='serial'")


def write_weights(model, folder: str | os.PathLike) -> Path:
    """The model's parameters as one uncompressed safetensors file in ``folder`` (written
    atomically; an existing file of the same fingerprint is kept)."""
    from attnlab.io.safetensors import save_tensors

    path = Path(folder) / f"weights-{fingerprint(model)}.safetensors"
    if not path.is_file():
        save_tensors(path, {n: np.asarray(p.data) for n, p in model.named_parameters()})
    return path


def map_weights(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only memory map (no bytes read yet)."""
    from attnlab.io.safetensors import DTYPES, read_header

    infos, _ = read_header(path)
    out = {}
    for name, info in infos.items():
        if info.end == info.begin:
            out[name] = np.zeros(info.shape, DTYPES[info.dtype])
            continue
        out[name] = np.memmap(path, dtype=DTYPES[info.dtype], mode="r", offset=info.begin, shape=info.shape)
    return out


def adopt(model, arrays: Mapping[str, np.ndarray], names: Mapping[str, tuple] | None = None) -> None:
    """Make ``arrays`` the model's parameters as they are (no copy, read-only stays
    read-only), after checking every name, shape and dtype."""
    own = dict(model.named_parameters())
    for name, p in own.items():
        a = arrays.get(name)
        if a is None or tuple(a.shape) != tuple(p.shape) or (names and str(a.dtype) != names[name][1]):
            raise ValueError(f"the shared weights do not fit the model's parameter {name!r}")
    for name, p in own.items():
        p.data = arrays[name].view(np.ndarray) if isinstance(arrays[name], np.memmap) else arrays[name]
