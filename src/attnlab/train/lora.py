"""LoRA on any decoder attnlab loads, as PEFT does it, with adapters in PEFT's format.

:func:`add` wraps the linear layers named by ``transformers``' module names (what PEFT's
``LoraConfig(target_modules=...)`` takes: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj`` for the Llama family; ``c_attn``, ``c_proj``,
``c_fc`` for GPT-2), whatever attnlab's own layers are called, with a trainable
:class:`~attnlab.nn.adapters.LoRA` each, and freezes every other parameter (their ``.grad``
stays None and the backward passes skip computing it). Where attnlab stacks what
``transformers`` keeps apart (a Llama's q, k and v in one ``in_proj_weight``) an adapter
covers the rows of the part PEFT adapts; where ``transformers`` itself fuses (GPT-2's
``c_attn``) it covers the whole matrix, as PEFT's does.

The mapping comes from one table, the family's name map
(``type(model).name_map(model.config)``: attnlab parameter -> the ``transformers`` tensors it
is made of, in order); a new family that has one gets LoRA with nothing added here.

PEFT's semantics, checked against ``peft`` 0.21.2 (the test suite compares gradients,
training steps and saved files with it):

- ``delta = scaling * B @ A`` with ``A (r, in)``, ``B (out, r)``; ``scaling = alpha / r``, or
  ``alpha / sqrt(r)`` with ``use_rslora``; per-module ``rank_pattern``/``alpha_pattern`` on
  loading;
- ``B`` starts at zero, ``A`` kaiming-uniform with ``a = sqrt(5)`` (PEFT's
  ``init_lora_weights=True``); the dropout acts on the adapter's input; ``bias="none"``;
- a saved adapter is a folder with ``adapter_config.json`` and ``adapter_model.safetensors``
  whose tensors are named ``base_model.model.<module>.lora_A.weight`` /
  ``...lora_B.weight`` (``<module>`` the ``transformers`` module's name, e.g.
  ``model.layers.0.self_attn.q_proj``); GPT-2's ``Conv1D`` layers are saved with
  ``fan_in_fan_out: true`` (the adapters' shapes are those of a ``Linear``'s either way).

>>> import numpy as np
>>> from attnlab.models import Llama, LlamaConfig
>>> model = Llama(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
...                           num_attention_heads=4, num_key_value_heads=2), rng=np.random.default_rng(0))
>>> model = add(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"), rng=np.random.default_rng(1))
>>> sorted(adapters(model))[:2]
['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']
>>> [name for name, p in model.named_parameters() if p.requires_grad][:2]
['blocks.0.attn.adapters.q_proj.lora_A', 'blocks.0.attn.adapters.q_proj.lora_B']
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write
from attnlab._validation import fmt_shape, generator, probability
from attnlab.io.files import CheckpointError, read_json
from attnlab.io.safetensors import load_tensors, read_header, save_tensors
from attnlab.nn.adapters import Adapters, LoRA
from attnlab.nn.attention import Attention
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module
from attnlab.quant import is_quantized

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "add", "adapters", "load_adapter", "merge", "save_adapter",
           "targets", "unmerge"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's names: PeftModel -> LoraModel -> the transformers model
_SAVED = re.compile(r"^base_model\.model\.(?P<key>.+)\.(?P<ab>lora_A|lora_B)\.weight$")


@dataclass(frozen=True)
class Target:
    """A linear layer adapters may wrap: ``key`` the ``transformers`` module's name, ``owner``
    the attnlab layer whose weight holds it (a :class:`~attnlab.nn.Linear`, or an
    :class:`~attnlab.nn.Attention`'s stacked in-projection) in rows ``start:stop``,
    ``in_features`` its input width, ``param`` attnlab's parameter name, ``conv1d``
    whether ``transformers`` stores it as a ``Conv1D``."""

    key: str
    owner: Module
    param: str
    start: int
    stop: int
    in_features: int
    conv1d: bool

    @property
    def slot_name(self) -> str:
        """The adapter's name in its layer's slot: the module's last name (``q_proj``)."""
        return self.key.rsplit(".", 1)[-1]


def _row_sizes(owner: Module, n: int, rows: int, param: str) -> list[int]:
    """How the rows of ``owner``'s weight split among ``n`` ``transformers`` tensors."""
    if n == 1:
        return [rows]
    if isinstance(owner, Attention) and n == 3:
        dq, dkv = owner.num_heads * owner.head_dim, owner.num_kv_heads * owner.head_dim
        return [dq, dkv, dkv]
    if rows % n:
        raise ValueError(f"{param} has {rows} rows, which do not split evenly among its {n} tensors")
    return [rows // n] * n


def targets(model: Module) -> list[Target]:
    """Every linear layer of ``model`` that adapters may wrap, in the model's order, from its
    family's name map (the output layer, whose product the model computes itself, and
    embeddings and norms are not among them).

    Raises:
        TypeError: a model without a ``transformers`` name map (``type(model).name_map``).
    """
    name_map_of = getattr(type(model), "name_map", None)
    config = getattr(model, "config", None)
    if name_map_of is None or config is None:
        raise TypeError(f"{type(model).__name__} has no transformers name map (type(model).name_map): LoRA "
                        "takes a decoder loaded from a transformers checkpoint or GGUF file (GPT-2, Llama, "
                        "Mistral, Qwen2/3, Gemma 2/3)")
    name_map = name_map_of(config)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out_param = getattr(model, "_out_param", None)
    conv1d = getattr(type(model), "conv1d_weights", lambda c: frozenset())(config)
    found = []
    for ours, sources in name_map.items():
        owner_name, _, pname = ours.rpartition(".")
        owner = modules.get(owner_name)
        p = params.get(ours)
        if p is None or p is out_param:
            continue
        if not ((isinstance(owner, Linear) and pname == "weight")
                or (isinstance(owner, Attention) and pname == "in_proj_weight")):
            continue
        if not all(s.endswith(".weight") for s in sources):
            continue
        rows, in_features = p.shape
        start = 0
        for src, n in zip(sources, _row_sizes(owner, len(sources), rows, ours), strict=True):
            found.append(Target(src[: -len(".weight")], owner, ours, start, start + n, in_features, ours in conv1d))
            start += n
    return found


def _matches(target_modules, key: str) -> bool:
    """PEFT's rule (``check_target_module_exists``): a string is a regular expression the
    whole name must match; a list names modules by their name or its last parts."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, key) is not None
    return any(key == t or key.endswith("." + t) for t in target_modules)


def _check_targets(target_modules) -> str | tuple[str, ...]:
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            try:
                re.compile(target_modules)
            except re.error as exc:
                raise ValueError(f"target_modules {target_modules!r} is not a regular expression: {exc}") from None
        return target_modules
    if not isinstance(target_modules, Sequence) or not target_modules or \
            not all(isinstance(t, str) and t for t in target_modules):
        raise TypeError("target_modules must be a non-empty list of module names (e.g. ('q_proj', 'v_proj')), "
                        f"a regular expression or 'all-linear', got {target_modules!r}")
    return tuple(dict.fromkeys(target_modules))


def _layer_names(found: list[Target]) -> str:
    names = list(dict.fromkeys(t.slot_name for t in found))
    return f"{', '.join(names)} (e.g. {found[0].key})" if found else "none"


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating) \
            or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    return float(alpha)


def add(model: Module, *, r: int = 8, alpha: float = 16, dropout: float = 0.0,
        target_modules: str | Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False,
        rng: np.random.Generator | None = None) -> Module:
    """Wrap the layers named by ``target_modules`` with LoRA adapters and freeze every other
    parameter (PEFT's ``get_peft_model(model, LoraConfig(...))``); returns ``model``, changed
    in place. The adapters start as PEFT's (``B = 0``: the model's outputs do not change).

    Args:
        model: a decoder with a ``transformers`` name map (GPT-2, Llama, Mistral, Qwen2/3,
            Gemma 2/3), with float weights to train (quantized ones serve inference only).
        r: the rank.
        alpha: ``lora_alpha``: ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: ``lora_dropout`` on each adapter's input, in training mode.
        target_modules: ``transformers`` module names (a name matches the module of that name
            and every module whose name ends with ``.`` + it), a regular expression the
            whole name must match, or ``"all-linear"`` (every linear layer but the output
            layer), as PEFT takes them.
        use_rslora: rank-stabilised scaling.
        rng: draws the adapters' ``A`` and their dropout masks.

    Raises:
        ValueError: ``r <= 0``, ``alpha <= 0``, a dropout outside ``[0, 1)``, names that
            match no layer (the message lists the layers the model has), a model that has
            adapters already.
        TypeError: a model without a name map; ``target_modules`` of the wrong type.
    """
    if isinstance(r, bool) or not isinstance(r, int | np.integer) or r <= 0:
        raise ValueError(f"r must be a positive int (the adapters' rank), got {r!r}")
    alpha = _check_alpha(alpha)
    dropout = probability(dropout, "dropout")
    target_modules = _check_targets(target_modules)
    found = targets(model)
    chosen = [t for t in found if _matches(target_modules, t.key)]
    if not chosen:
        hint = " (a string is a regular expression the whole module name must match, as in PEFT: give a list " \
            "of names, e.g. ['q_proj'])" if isinstance(target_modules, str) else ""
        shown = target_modules if isinstance(target_modules, str) else list(target_modules)
        raise ValueError(f"target_modules {shown!r} match no linear layer of this {type(model).__name__}"
                         f"{hint}; its layers: {_layer_names(found)}")
    return _attach(model, chosen, {t.key: (int(r), alpha) for t in chosen}, dropout=dropout, use_rslora=use_rslora,
                   rng=generator(rng), config={"r": int(r), "lora_alpha": alpha, "lora_dropout": dropout,
                                               "target_modules": target_modules, "use_rslora": bool(use_rslora)})


def _attach(model, chosen: list[Target], shapes: dict, *, dropout: float, use_rslora: bool, rng, config: dict):
    if adapters(model):
        raise ValueError(f"this {type(model).__name__} has adapters already ({_layer_names(_adapted(model))}): "
                         "one set of adapters per model; load or add them to a fresh model")
    dtype = model.dtype
    for t in chosen:
        r, alpha = shapes[t.key]
        slot = t.owner.adapters
        if slot is None:
            t.owner.adapters = slot = Adapters()
        setattr(slot, t.slot_name, LoRA(t.in_features, t.stop - t.start, r, alpha=alpha, dropout=dropout,
                                        start=t.start, use_rslora=use_rslora, rng=rng, dtype=dtype))
    adapted = {id(lora) for lora in adapters(model).values()}
    for _, m in model.named_modules():
        for p in m._parameters.values():
            if p is not None:
                p.requires_grad = id(m) in adapted
    object.__setattr__(model, "lora_config", dict(config))
    model.train(model.training)  # the new modules take the model's mode
    return model


def _adapted(model: Module) -> list[Target]:
    return [t for t in targets(model) if t.owner.adapters is not None
            and isinstance(getattr(t.owner.adapters, t.slot_name, None), LoRA)]


def adapters(model: Module) -> dict[str, LoRA]:
    """The model's adapters by ``transformers`` module name (``model.layers.0.self_attn.q_proj``),
    in the model's order; empty without adapters (or for a model without a name map)."""
    if getattr(type(model), "name_map", None) is None or getattr(model, "config", None) is None:
        return {}
    out = {}
    for t in targets(model):
        slot = t.owner.adapters
        lora = getattr(slot, t.slot_name, None) if slot is not None else None
        if isinstance(lora, LoRA) and lora.start == t.start:
            out[t.key] = lora
    return out


def merge(model: Module) -> Module:
    """Fold every unmerged adapter into its layer's weight (``W[rows] += scaling * B @ A``,
    PEFT's ``merge_adapter``): the forward pass then costs what the model alone costs and
    gives the same outputs (to rounding). Returns ``model``.

    Raises:
        ValueError: a model without adapters.
        TypeError: quantized weights (they cannot take the sum).
    """
    return _fold(model, merged=True)


def unmerge(model: Module) -> Module:
    """Take merged adapters back out of the weights (``W[rows] -= scaling * B @ A``, PEFT's
    ``unmerge_adapter``; to rounding): they compute beside the weights again and can train.
    Returns ``model``."""
    return _fold(model, merged=False)


def _fold(model: Module, *, merged: bool) -> Module:
    """Add (``merged``) or subtract each adapter's term where it is not so already."""
    params = dict(model.named_parameters())
    found = _with_adapters(model)
    for t, lora in found:  # every weight checked before any changes
        if lora.merged != merged and is_quantized(params[t.param].data):
            raise TypeError(f"{t.param} is kept quantized ({params[t.param].data.kind}): an adapter cannot be "
                            "merged into quantized weights; load the model dequantized (without quantized=True) "
                            "to merge, or keep the adapters unmerged")
    for t, lora in found:
        if lora.merged != merged:
            rows = params[t.param].data[t.start:t.stop]
            delta = lora.delta_weight().astype(rows.dtype, copy=False)
            if merged:
                rows += delta
            else:
                rows -= delta
            lora.merged = merged
    return model


def _with_adapters(model) -> list[tuple[Target, LoRA]]:
    found = adapters(model)
    if not found:
        raise ValueError(f"this {type(model).__name__} has no adapters: add them with attnlab.train.lora.add or "
                         "load_adapter first")
    by_key = {t.key: t for t in targets(model)}
    return [(by_key[k], lora) for k, lora in found.items()]


# ---- PEFT's files -------------------------------------------------------------------------
def _most_common(values):
    return Counter(values).most_common(1)[0][0]


def adapter_config(model: Module) -> dict:
    """The ``adapter_config.json`` PEFT writes for the model's adapters (``LoraConfig``'s
    fields); ranks and alphas that differ from the most common go to ``rank_pattern`` and
    ``alpha_pattern`` under their module's full name."""
    found = _with_adapters(model)
    kept = getattr(model, "lora_config", {})
    r = _most_common([lora.r for _, lora in found])
    alpha = _most_common([lora.alpha for _, lora in found])
    targets_ = kept.get("target_modules") or sorted({t.slot_name for t, _ in found})
    alpha_out = int(alpha) if float(alpha).is_integer() else alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": getattr(model, "name", None),
        "r": r,
        "lora_alpha": alpha_out,
        "lora_dropout": _most_common([lora.dropout for _, lora in found]),
        "target_modules": targets_ if isinstance(targets_, str) else sorted(targets_),
        "bias": "none",
        "fan_in_fan_out": any(t.conv1d for t, _ in found),
        "use_rslora": any(lora.use_rslora for _, lora in found),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {t.key: lora.r for t, lora in found if lora.r != r},
        "alpha_pattern": {t.key: lora.alpha for t, lora in found if lora.alpha != alpha},
        "layers_to_transform": None,
        "layers_pattern": None,
        "use_dora": False,
        "revision": None,
    }


def _writable_folder(folder: Path) -> Path:
    """``folder`` made if absent (with its parents) and checked writable, before anything is
    written into it."""
    if folder.exists() and not folder.is_dir():
        raise OSError(f"{folder} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder} is not writable")
    return folder


def save_adapter(model: Module, folder: str | os.PathLike) -> Path:
    """Write the model's adapters as PEFT does (``PeftModel.save_pretrained``):
    ``adapter_config.json`` and ``adapter_model.safetensors`` in ``folder`` (made if
    absent), each written atomically. ``peft.PeftModel.from_pretrained(hf_model, folder)``
    loads them onto the ``transformers`` model; :func:`load_adapter` reads them back.
    Merged adapters are saved as they are (their ``A`` and ``B``). Returns the folder.

    Raises:
        ValueError: a model without adapters.
        OSError: a folder that cannot be made or written (nothing is written then).
    """
    config = adapter_config(model)
    tensors = {}
    for key, lora in adapters(model).items():
        tensors[f"{_PREFIX}{key}.lora_A.weight"] = np.ascontiguousarray(lora.lora_A.data)
        tensors[f"{_PREFIX}{key}.lora_B.weight"] = np.ascontiguousarray(lora.lora_B.data)
    folder = _writable_folder(Path(folder))
    save_tensors(folder / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write(folder / ADAPTER_CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    return folder


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key``: the first pattern ``p`` with ``(.*\\.)?(p)$`` matching ``key``."""
    for p, value in patterns.items():
        if re.match(rf"(.*\.)?({p})$", key):
            return value
    return default


def _read_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    c = read_json(path)
    if c.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type is {c.get('peft_type')!r}; attnlab reads LoRA adapters only")
    unsupported = [(k, v) for k, v in (("use_dora", c.get("use_dora")), ("lora_bias", c.get("lora_bias")),
                                       ("modules_to_save", c.get("modules_to_save")),
                                       ("target_parameters", c.get("target_parameters")),
                                       ("trainable_token_indices", c.get("trainable_token_indices")),
                                       ("layer_replication", c.get("layer_replication"))) if v]
    if c.get("bias", "none") != "none":
        unsupported.append(("bias", c["bias"]))
    if unsupported:
        what = ", ".join(f"{k}={v!r}" for k, v in unsupported)
        raise CheckpointError(f"{path}: {what} is not supported (attnlab reads plain LoRA adapters of linear "
                              "layers, bias='none')")
    for name in ("r", "lora_alpha"):
        value = c.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise CheckpointError(f"{path}: {name} must be a positive number, got {value!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(c.get(name) or {}, dict):
            raise CheckpointError(f"{path}: {name} must be an object, got {c.get(name)!r}")
    drop = c.get("lora_dropout", 0.0) or 0.0
    if isinstance(drop, bool) or not isinstance(drop, int | float) or not 0 <= drop < 1:
        raise CheckpointError(f"{path}: lora_dropout must be in [0, 1), got {drop!r}")
    return c


def load_adapter(model: Module, folder: str | os.PathLike, *, merge: bool = False,
                 rng: np.random.Generator | None = None) -> Module:
    """Load a LoRA adapter written by PEFT (``PeftModel.save_pretrained``) or by
    :func:`save_adapter`: adapters are added where the file has them (a model without
    adapters gets them; one with adapters on the same layers and of the same ranks gets the
    file's values), every other parameter frozen. ``merge=True`` then folds them into the
    weights (:func:`merge`: inference at the model's own cost). Returns ``model``.

    Everything is checked before any tensor is read: the config (LoRA of linear layers,
    ``bias="none"``; ``rank_pattern``, ``alpha_pattern`` and ``use_rslora`` are honoured),
    every tensor name a layer of this model, every shape the one that layer needs.

    Args:
        model: the decoder the adapter was trained on.
        folder: holding ``adapter_config.json`` and ``adapter_model.safetensors``.
        merge: fold the adapters into the weights after loading.
        rng: the adapters' dropout masks, should they train further.

    Raises:
        FileNotFoundError: no such folder or file (a ``.bin`` adapter is pickle: not read).
        CheckpointError (a ValueError): a config attnlab does not read; an adapter made for
            another model (a layer it does not have, or shapes that differ: both named).
        ValueError: a model whose adapters are on other layers or of other ranks.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(2, "no such adapter folder (it holds adapter_config.json and "
                                   "adapter_model.safetensors)", str(folder))
    weights = folder / ADAPTER_WEIGHTS
    if not weights.exists() and (folder / "adapter_model.bin").exists():
        raise FileNotFoundError(2, "no adapter_model.safetensors (adapter_model.bin is a pickle file, which "
                                   "attnlab never reads: save the adapter with safe_serialization=True)", str(weights))
    config = _read_config(folder)
    infos = read_header(weights)[0]
    by_key = {t.key: t for t in targets(model)}
    pairs: dict[str, dict[str, str]] = {}
    for name in infos:
        m = _SAVED.match(name)
        if m is None:
            raise CheckpointError(f"{weights}: tensor {name!r} is not a LoRA weight of a linear layer "
                                  "(base_model.model.<module>.lora_A.weight or .lora_B.weight)")
        pairs.setdefault(m["key"], {})[m["ab"]] = name
    if not pairs:
        raise CheckpointError(f"{weights} holds no tensors")
    ranks = {}
    for key, ab in pairs.items():
        t = by_key.get(key)
        if t is None:
            raise CheckpointError(f"{weights}: the adapter is for another model: {key} is not a linear layer of this "
                                  f"{type(model).__name__} ({getattr(model, 'name', '')}); its layers: "
                                  f"{_layer_names(list(by_key.values()))}")
        if set(ab) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights}: {key} has {', '.join(sorted(ab))} but not both lora_A and lora_B")
        a, b = infos[ab["lora_A"]], infos[ab["lora_B"]]
        r = a.shape[0] if len(a.shape) == 2 else 0
        need_a, need_b = (r, t.in_features), (t.stop - t.start, r)
        for name, info, need in ((ab["lora_A"], a, need_a), (ab["lora_B"], b, need_b)):
            if r < 1 or tuple(info.shape) != need:
                raise CheckpointError(f"{weights}: the adapter is for another model: {name} has shape "
                                      f"{fmt_shape(info.shape)}, but this {type(model).__name__}'s {key} needs "
                                      f"{fmt_shape(need)}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"])
        ranks[key] = (r, _check_alpha(alpha))
    chosen = [by_key[k] for k in by_key if k in pairs]
    existing = adapters(model)
    if existing:
        have = {k: lora.r for k, lora in existing.items()}
        want = {k: r for k, (r, _) in ranks.items()}
        if have != want:
            raise ValueError(f"this {type(model).__name__} has adapters on other layers or of other ranks than "
                             f"{folder}'s: load it into a model without adapters")
    tensors = load_tensors(weights, list(infos), dtype=model.dtype)
    if not existing:
        _attach(model, chosen, ranks, dropout=float(config.get("lora_dropout") or 0.0),
                use_rslora=bool(config.get("use_rslora")), rng=generator(rng),
                config={"r": config["r"], "lora_alpha": config["lora_alpha"],
                        "lora_dropout": float(config.get("lora_dropout") or 0.0),
                        "target_modules": config.get("target_modules"), "use_rslora": bool(config.get("use_rslora"))})
    found = adapters(model)
    was_merged = any(lora.merged for lora in found.values())
    if was_merged:
        _fold(model, merged=False)
    for key, ab in pairs.items():
        lora = found[key]
        lora.lora_A.data[...] = tensors[ab["lora_A"]]
        lora.lora_B.data[...] = tensors[ab["lora_B"]]
        lora.alpha = ranks[key][1]
        lora.use_rslora = bool(config.get("use_rslora"))
        lora.scaling = lora.alpha / (math.sqrt(lora.r) if lora.use_rslora else lora.r)
    if merge or was_merged:
        _fold(model, merged=True)
    return model
