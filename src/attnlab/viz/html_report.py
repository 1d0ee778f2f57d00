"""The interactive attention report: one self-contained HTML file.

:func:`write_report` (also ``attnlab.viz.report(explanation, path)``) writes an
:class:`~attnlab.explain.Explanation` as ONE HTML file that draws it in the browser: the head
view (tokens left and right, lines weighted by attention), the model view (a layers x heads
grid of thumbnails), a heatmap with the value under the pointer, the step view of the
trace of one attention call (X, Q, K, V, scores, weights, output with their shapes) and the
static -> contextual embedding plot; for decoders also the logit lens (layers x positions,
the likeliest next token in each cell, shaded by its probability), the head detector
scores (a blocks x heads heatmap per kind) and, when the explanation has one, the
activation-patching heatmap (blocks x positions); with ``explain --attribute`` also the
input attribution (the tokens shaded by score), attribution patching beside activation
patching (blocks x positions) and the circuit that EAP-IG finds, drawn as a graph of heads.
Every view exports as PNG or SVG.

The file makes no network request of any kind: script and style are inlined, the numbers
are embedded, and a Content-Security-Policy forbids every fetch except ``data:``/``blob:``
images. It works from ``file://`` and offline.

Numbers are stored compactly: every attention row is quantised to ``uint8`` relative to
the row's maximum (so a value is exact to ``row max / 510``; a report that would pass
``MAX_BYTES``, 10 MB, gets fewer levels: 6, 5, 4, 3 or 2 bits), the trace's arrays are
``float32``, the whole binary block is zlib-compressed and base64-encoded; the browser
inflates it with its built-in ``DecompressionStream``. The embedding plot's 2-D points are
the first two principal components of the static and contextual vectors together,
computed here with NumPy.

A text longer than ``LONG_INPUT`` (2,000) tokens gives a ``UserWarning`` and is drawn
``WINDOW`` (500) tokens at a time, with a control that moves the window: drawing every token
of a 10,000-token text would freeze the page. Any text can be written: lone surrogates
become U+FFFD, and the browser shows the characters XML forbids as visible symbols, so an
exported SVG always parses.

User text (the input, the tokens, the model's name, the notes) only ever reaches the page
as JSON inside ``<script type="application/json">`` with ``<``, ``>`` and ``&`` escaped, or
HTML-escaped; the script writes it with ``textContent``. No event handler is written into
the markup.

:func:`render_html` gives the HTML as a string; ``inline=True`` gives a fragment for a
Jupyter output cell (what :meth:`Explanation._repr_html_` shows).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import warnings
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write

__all__ = ["render_html", "write_report"]

_ASSETS = "assets"
# Content-Security-Policy of the full page: nothing may be fetched; only our own script
# (by hash) runs; images only from data:/blob: (the heatmaps and the PNG export).
_CSP = (
    "default-src 'none'; script-src '{script_hash}'; style-src 'unsafe-inline'; "
    "img-src data: blob:; base-uri 'none'; form-action 'none'"
)
# Steps larger than this many values are left out of the step view (with a note).
_MAX_STEP_VALUES = 1 << 20
#: The report's size target in bytes: when 8-bit attention codes would make a larger file,
#: the codes get fewer levels (see :data:`CODE_LEVELS`), and the report says so.
MAX_BYTES = 10_000_000
#: The attention code ranges tried in turn: 8, 6, 5, 4, 3 and 2 bits per weight.
CODE_LEVELS = (255, 63, 31, 15, 7, 3)
# Attention with fewer weights than this is never re-quantised to fit (one pass, 8 bits).
_SMALL_ATTENTION = 1 << 22
# Longer inputs are shown WINDOW tokens at a time (with a warning): drawing every token of a
# 10,000-token text would freeze the page for many seconds.
LONG_INPUT = 2000
WINDOW = 500
# C0 controls (but tab, newline, carriage return) and DEL are not allowed in XML (an exported
# SVG) and invisible on screen: the header shows them as their Unicode "control pictures".
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if c not in (9, 10, 13)} | {0x7F: 0x2421}
_NONCHARACTERS = {0xFFFE: 0xFFFD, 0xFFFF: 0xFFFD}


def _asset(name: str) -> str:
    return resources.files("attnlab.viz").joinpath(_ASSETS, name).read_text(encoding="utf-8")


def clean_text(text: object) -> str:
    """``str(text)`` with every lone surrogate (which no file can encode) replaced by U+FFFD;
    a surrogate pair becomes the character it encodes.

    >>> clean_text("a\\ud800b"), clean_text("\\ud83d\\ude00")
    ('a\ufffdb', '😀')
    """
    text = str(text)
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def visible_text(text: object) -> str:
    """:func:`clean_text`, with the characters XML forbids shown as visible symbols (NUL as
    "␀", U+FFFE/U+FFFF as U+FFFD).

    >>> visible_text("a\\x00b\\x1fc\\ufffe")
    'a␀b␟c\ufffd'
    """
    return clean_text(text).translate(_CONTROL_PICTURES).translate(_NONCHARACTERS)


def _json_for_script(obj: object) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``<``, ``>``, ``&``."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


class _Blob:
    """Arrays packed one after the other (4-byte aligned), described by offset/dtype/shape."""

    _CODES = {np.dtype(np.uint8): "u8", np.dtype(np.uint16): "u16", np.dtype(np.uint32): "u32",
              np.dtype(np.float32): "f32"}

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, arr: np.ndarray) -> dict:
        arr = np.ascontiguousarray(arr)
        code = self._CODES[arr.dtype]
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        ref = {"offset": self.size, "dtype": code, "shape": list(arr.shape)}
        pad = (-len(data)) % 4
        self.parts.append(data + b"\0" * pad)
        self.size += len(data) + pad
        return ref

    def encode(self) -> str:
        return base64.b64encode(zlib.compress(b"".join(self.parts), 6)).decode("ascii")


def _check_2d(x: object, name: str, T: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"explanation.{name} must be a real number array, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] != T or arr.shape[1] < 1:
        raise ValueError(
            f"explanation.{name} has shape {arr.shape}, but should be ({T}, D): one row per token"
        )
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"explanation.{name} contains NaN or infinity")
    return arr


def _check(explanation: object) -> tuple[list[str], np.ndarray]:
    for attr in ("text", "tokens", "model", "attentions", "static", "contextual"):
        if not hasattr(explanation, attr):
            raise TypeError(
                f"explanation must be an attnlab.explain.Explanation (it has no {attr!r}), "
                f"got {type(explanation).__name__}"
            )
    tokens = explanation.tokens
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise TypeError("explanation.tokens must be a list of str")
    tokens = [clean_text(t) for t in tokens]
    T = len(tokens)
    if T == 0:
        raise ValueError("explanation.tokens is empty: there is nothing to draw")
    att = np.asarray(explanation.attentions)
    if att.dtype.kind not in "fiu":
        raise TypeError(f"explanation.attentions must be a float array, got dtype {att.dtype}")
    if att.ndim != 4 or att.shape[2:] != (T, T) or att.shape[0] < 1 or att.shape[1] < 1:
        raise ValueError(
            f"explanation.attentions has shape {att.shape}, but should be "
            f"(layers, heads, {T}, {T}) with at least one layer and one head"
        )
    att = att.astype(np.float32)
    if not np.isfinite(att).all():
        raise ValueError("explanation.attentions contains NaN or infinity")
    lo, hi = float(att.min()), float(att.max())
    if lo < -1e-6 or hi > 1 + 1e-3:
        raise ValueError(
            f"explanation.attentions must hold weights in [0, 1], got values in [{lo:g}, {hi:g}]"
        )
    return tokens, np.clip(att, 0.0, 1.0)


def quantize_rows(att: np.ndarray, levels: int = 255) -> tuple[np.ndarray, np.ndarray]:
    """Quantise attention rows to ``uint8`` relative to each row's maximum.

    Args:
        att: ``(..., L, S)`` weights in ``[0, 1]``.
        levels: the largest code (255: 8 bits; 15: 4 bits).

    Returns:
        ``(codes, rowmax)``: ``(..., L, S)`` uint8 and ``(..., L)`` float32, with
        ``att ~= codes / levels * rowmax[..., None]`` to within ``rowmax / (2 levels)``.

    >>> a = np.array([[0.7, 0.2, 0.1], [0.0, 0.0, 0.0]])
    >>> codes, rowmax = quantize_rows(a)
    >>> codes.tolist(), rowmax.tolist()
    ([[255, 73, 36], [0, 0, 0]], [0.699999988079071, 0.0])
    """
    att = np.asarray(att, dtype=np.float32)
    rowmax = att.max(axis=-1)
    safe = np.where(rowmax > 0, rowmax, 1.0)[..., None]
    codes = np.rint(att / safe * float(levels)).clip(0, levels).astype(np.uint8)
    return codes, rowmax.astype(np.float32)


def _sampled_size(att: np.ndarray, levels: int) -> float:
    """The base64 size of ``att``'s codes at ``levels``, estimated from 32 of its maps."""
    maps = att.reshape(-1, *att.shape[-2:])
    pick = np.unique(np.linspace(0, len(maps) - 1, min(len(maps), 32)).astype(int))
    codes, _ = quantize_rows(maps[pick], levels)
    return len(zlib.compress(codes.tobytes(), 6)) * len(maps) / len(pick) * 4 / 3


def _pack(data: dict, att: np.ndarray, levels: int, pending: dict) -> None:
    """Fill ``data["arrays"]``, ``data["blob"]`` and ``data["levels"]``: the attention codes
    at ``levels``, the row maxima and the ``pending`` arrays in one compressed block."""
    blob = _Blob()
    codes, rowmax = quantize_rows(att, levels)
    if att.size > _SMALL_ATTENTION:  # row maxima in units of 1/65535 (floats hardly compress)
        rowmax = np.rint(rowmax.astype(np.float64) * 65535).astype(np.uint16)
    arrays = {"attn": blob.add(codes), "rowmax": blob.add(rowmax)}
    del codes
    for key, a in pending.items():
        arrays[key] = blob.add(a)
    data.update(levels=int(levels), arrays=arrays, blob=blob.encode())


def _page_size(data: dict) -> int:
    """Bytes of the whole page that :func:`render_html` makes of ``data``."""
    return len(_page(data).encode("utf-8"))


def pca_2d(static: np.ndarray, contextual: np.ndarray) -> dict:
    """2-D principal-component coordinates of the static and contextual vectors.

    As :func:`attnlab.viz.plots.plot_embeddings` does: when both have the same
    width ``D`` the axes are fitted on the static vectors and project both sets, so an
    arrow from a token's static point to its contextual point shows how attention moved
    it. Otherwise each set gets its own projection.

    Args:
        static: ``(T, D)`` token vectors before attention.
        contextual: ``(T, D')`` token vectors after the last layer.

    Returns:
        ``{"static": (T, 2) list, "contextual": (T, 2) list, "joint": bool,
        "explained": [share of the static vectors' variance on PC1, PC2]}``.

    >>> rng = np.random.default_rng(0)
    >>> p = pca_2d(rng.standard_normal((5, 8)), rng.standard_normal((5, 8)))
    >>> len(p["static"]), len(p["static"][0]), p["joint"]
    (5, 2, True)
    """
    from attnlab.viz.plots import pca_fit

    def project(x, mean, axes):
        return np.round((np.asarray(x, dtype=np.float64) - mean) @ axes.T, 5).tolist()

    mean, axes, explained = pca_fit(static)
    joint = static.shape[1] == contextual.shape[1]
    fit_c = (mean, axes) if joint else pca_fit(contextual)[:2]
    return {
        "static": project(static, mean, axes),
        "contextual": project(contextual, *fit_c),
        "joint": joint,
        "explained": np.round(explained, 4).tolist(),
    }


def _field(record: object, name: str, default: object = None) -> object:
    if isinstance(record, dict):
        return record.get(name, default)
    return getattr(record, name, default)


def trace_steps(trace: object) -> list[dict]:
    """The steps of a trace as plain dicts ``{name, values, head, description}``.

    Accepts an :class:`attnlab.trace.Trace` (or anything with a ``steps`` list), a list of
    records, or a list of dicts; each record has ``name`` and ``values`` and optionally
    ``head`` and ``description``. ``None`` gives ``[]``.

    >>> trace_steps([{"name": "X", "values": [[1.0, 2.0]]}])[0]["values"].shape
    (1, 2)
    """
    if trace is None:
        return []
    records = _field(trace, "steps", trace)
    if isinstance(records, dict) or isinstance(records, str | bytes):
        raise TypeError("explanation.trace must have a list of steps (records with name, values)")
    try:
        records = list(records)
    except TypeError:
        raise TypeError(
            f"explanation.trace must be a Trace or a list of steps, got {type(trace).__name__}"
        ) from None
    steps = []
    for i, rec in enumerate(records):
        name = _field(rec, "name")
        values = _field(rec, "values")
        if not isinstance(name, str) or values is None:
            raise TypeError(f"explanation.trace step {i} needs a str name and values")
        arr = np.asarray(values, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[None, :]  # (n,) -> (1, n): a bias drawn as one row
        if arr.ndim != 2:
            raise ValueError(
                f"explanation.trace step {i} ({name!r}) has shape {arr.shape}, "
                "but should be 1-D or 2-D"
            )
        head = _field(rec, "head")
        steps.append(
            {
                "name": clean_text(name),
                "values": arr,
                "shape": list(np.shape(values)),
                "head": None if head is None else int(head),
                "description": clean_text(_field(rec, "description", "") or ""),
            }
        )
    return steps


def _shown(explanation: object, tokens: list[str]) -> list[str]:
    """``tokens`` as a person reads them, where the explanation knows its tokenizer's code
    (:meth:`~attnlab.explain.Explanation.readable_tokens`); else as they are."""
    readable = getattr(explanation, "readable_tokens", None)
    return [clean_text(t) for t in readable(tokens)] if readable is not None else tokens


#: The report's views, in its tabs' order.
VIEWS = ("head", "model", "heatmap", "steps", "embedding", "lens", "detectors", "patching", "rollout")
#: The views that draw the attention maps.
_MAP_VIEWS = {"head", "model", "heatmap"}


def _payload(explanation: object, max_bytes: int | None = None, views=None) -> dict:
    """The report's data; with ``views`` only what those views draw (the rest empty)."""
    want = set(VIEWS if views is None else views)
    tokens, att = _check(explanation)
    tokens = _shown(explanation, tokens)
    if not want & _MAP_VIEWS:
        att = att[:0]  # no map drawn: none sent
    T = len(tokens)
    static = _check_2d(explanation.static, "static", T)
    contextual = _check_2d(explanation.contextual, "contextual", T)
    pending: dict[str, np.ndarray] = {}  # arrays for the compressed block, after the attention
    notes = [clean_text(n) for n in (getattr(explanation, "notes", None) or [])]
    window = None
    if T > LONG_INPUT:
        window = WINDOW
        warnings.warn(
            f"the report's text has {T} tokens: the browser shows {WINDOW} of them at a time "
            "(a control moves the window)",
            UserWarning,
            stacklevel=3,
        )

    steps = []
    for i, step in enumerate(trace_steps(getattr(explanation, "trace", None) if "steps" in want else None)):
        values = step.pop("values")
        if values.size > _MAX_STEP_VALUES:
            notes.append(f"step view: {step['name']} {tuple(values.shape)} is too large to embed")
            continue
        key = f"step{i}"
        pending[key] = values.astype(np.float32)  # -inf (masked scores) survives
        step["array"] = key
        steps.append(step)

    layers, heads = np.shape(explanation.attentions)[:2]
    inside = _inside(explanation, pending, tokens, int(layers), int(heads), want)
    inside["attribution"] = _attribution(explanation, pending, T, int(layers))
    # The view opens on the explanation's layer (numbered 1..n; index layer - 1) and head.
    layer = getattr(explanation, "layer", None) or layers
    head = getattr(explanation, "head", None) or 0
    data = {
        "format": 1,
        "model": clean_text(explanation.model),
        "text": clean_text(explanation.text),
        "created": clean_text(getattr(explanation, "created", "") or ""),
        "notes": notes,
        "tokens": tokens,
        "layers": int(layers),
        "heads": int(heads),
        "layer": min(max(int(layer), 1), int(layers)) - 1,
        "head": int(head) % int(heads),
        "T": T,
        "unknown": int(getattr(explanation, "unknown", 0) or 0),
        "window": window,
        "embedding": pca_2d(static, contextual) if "embedding" in want else None,
        "steps": steps,
        **inside,
        "levels": 255,
        "arrays": {},
        "blob": "",
    }
    limit = MAX_BYTES if max_bytes is None else int(max_bytes)
    levels = [255]
    if att.size > _SMALL_ATTENTION:  # start at the first code range the estimate says fits
        levels = list(CODE_LEVELS)
        _pack(data, np.zeros((1, 1, 1, 1), np.float32), 255, pending)
        room = limit - _page_size(data) - int(np.prod(att.shape[:-1])) * 2 * 4 / 3  # row maxima
        fits = [lv for lv in levels if _sampled_size(att, lv) <= room]
        levels = levels[levels.index(fits[0]):] if fits else levels[-1:]
    for lv in levels:  # then check the real size, with fewer levels while it is too large
        _pack(data, att, lv, pending)
        if _page_size(data) <= limit:
            break
    if data["levels"] == levels[0] and levels[0] != CODE_LEVELS[0] and _page_size(data) <= limit:
        # the estimate skipped the range above: it may fit after all (the estimate is a sample's)
        chosen = dict(data)
        _pack(data, att, CODE_LEVELS[CODE_LEVELS.index(levels[0]) - 1], pending)
        if _page_size(data) > limit:
            data.update(chosen)
    fits = _page_size(data) <= limit
    if data["levels"] != 255:
        bits = int(data["levels"]).bit_length()
        why = f"to keep the report under {limit / 1e6:g} MB" if fits else f"the fewest offered (the report is " \
              f"still more than {limit / 1e6:g} MB)"
        notes.append(f"attention weights stored with {bits} bits (instead of 8) relative to each row's maximum, "
                     f"{why}: each weight within {50 / data['levels']:.2g}% of its row's maximum")
    if att.size > _SMALL_ATTENTION and not fits:
        warnings.warn(f"the report is {_page_size(data) / 1e6:.1f} MB, more than {limit / 1e6:.3g} MB, even with "
                      f"{int(data['levels']).bit_length()}-bit attention codes", UserWarning, stacklevel=3)
    return data


def _finite(a: np.ndarray, name: str) -> np.ndarray:
    if a.dtype.kind not in "fiu":
        raise TypeError(f"explanation.{name} must be a real number array, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"explanation.{name} contains NaN or infinity")
    return a


def _inside(explanation: object, pending: dict, tokens: list[str], layers: int, heads: int,
            want: set | None = None) -> dict:
    """The logit lens, the head detector scores and the patching result (each None when the
    explanation has none, or ``want`` has not their view), checked against the maps' shape;
    big arrays go to ``pending``."""
    want = set(VIEWS) if want is None else want
    T = len(tokens)
    out: dict = {"lens": None, "detectors": None, "patching": None, "rollout": False}
    rollout = getattr(explanation, "rollout", None) if "rollout" in want else None
    if rollout is not None:
        r = np.asarray(rollout)
        if r.shape != (layers, T, T):
            raise ValueError(f"explanation.rollout has shape {r.shape}, but should be ({layers}, {T}, {T})")
        codes, rowmax = quantize_rows(np.clip(_finite(r, "rollout"), 0.0, 1.0))
        pending["roll"], pending["roll_max"] = codes, rowmax
        out["rollout"] = True
    lens = getattr(explanation, "lens", None) if "lens" in want else None
    if lens is not None:
        ids, probs = np.asarray(lens.ids), np.asarray(lens.probs)
        if ids.ndim != 3 or ids.shape[:2] != (layers + 1, T) or ids.shape[2] < 1 or probs.shape != ids.shape:
            raise ValueError(f"explanation.lens has ids {ids.shape} and probs {probs.shape}, but both should be "
                             f"({layers + 1}, {T}, k): layers 0..{layers} by tokens")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"explanation.lens.ids must be integer token ids, got dtype {ids.dtype}")
        probs = _finite(probs, "lens.probs")
        used, index = np.unique(ids, return_inverse=True)
        try:
            strings = _shown(explanation, [clean_text(lens.strings[int(i)]) for i in used])
        except KeyError as exc:
            raise ValueError(f"explanation.lens.strings has no string for token id {exc.args[0]}") from None
        index = index.reshape(ids.shape).astype(np.uint16 if len(used) <= 1 << 16 else np.uint32)
        pending["lens_index"] = index
        pending["lens_p"] = np.clip(probs, 0.0, 1.0).astype(np.float32)
        out["lens"] = {"k": int(ids.shape[2]), "strings": strings}
    scores = getattr(explanation, "head_scores", None) if "detectors" in want else None
    if scores is not None:
        kinds = {}
        for kind, v in scores.items():
            v = np.asarray(v)
            if v.shape != (layers, heads):
                raise ValueError(f"explanation.head_scores[{kind!r}] has shape {v.shape}, but should be "
                                 f"({layers}, {heads}): blocks by heads")
            v = _finite(v, f"head_scores[{kind!r}]")
            kinds[clean_text(kind)] = np.round(v, 4).tolist()
        out["detectors"] = kinds
    patching = getattr(explanation, "patching", None) if "patching" in want else None
    if patching is not None:
        values = np.asarray(patching.values)
        if values.shape != (layers, T):
            raise ValueError(f"explanation.patching.values has shape {values.shape}, but should be "
                             f"({layers}, {T}): blocks by tokens")
        corrupted = _shown(explanation, [clean_text(t) for t in patching.corrupted_tokens])
        if len(corrupted) != T:
            raise ValueError(f"explanation.patching.corrupted_tokens has {len(corrupted)} tokens, but the text "
                             f"has {T}")
        pending["patch"] = _finite(values, "patching.values").astype(np.float32)
        out["patching"] = {
            "hook": clean_text(patching.hook), "metric": clean_text(patching.metric),
            "corrupted_text": clean_text(patching.corrupted_text), "corrupted_tokens": corrupted,
            "clean_token": _shown(explanation, [clean_text(patching.clean_token)])[0],
            "corrupted_token": _shown(explanation, [clean_text(patching.corrupted_token)])[0],
            "clean_value": float(patching.clean_value), "corrupted_value": float(patching.corrupted_value),
        }
    return out


def _attribution(explanation: object, pending: dict, T: int, layers: int) -> dict | None:
    """``explain --attribute``'s input attribution, attribution patching and circuit (None
    without them); the per-token scores and the ``(layers, T)`` AtP go to ``pending``."""
    a = getattr(explanation, "attribution", None)
    if a is None:
        return None
    scores = np.asarray(a.scores)
    if scores.shape != (T,):
        raise ValueError(f"explanation.attribution.scores has shape {scores.shape}, but should be ({T},)")
    pending["attr"] = _finite(scores, "attribution.scores").astype(np.float32)
    def num(x):  # JSON has no NaN: an undefined share (equal metrics) is null
        x = float(x)
        return x if np.isfinite(x) else None

    out = {"target_token": clean_text(a.target_token), "method": clean_text(a.method), "steps": int(a.steps),
           "baseline": clean_text(a.baseline), "value": num(a.value), "baseline_value": num(a.baseline_value),
           "gap": num(a.gap), "atp": False, "circuit": None}
    if a.atp is not None and getattr(explanation, "patching", None) is not None:
        atp = np.asarray(a.atp)
        if atp.shape != (layers, T):
            raise ValueError(f"explanation.attribution.atp has shape {atp.shape}, but should be ({layers}, {T})")
        pending["atp"] = _finite(atp, "attribution.atp").astype(np.float32)
        out["atp"] = True
    c = a.circuit
    if c is not None:
        out["circuit"] = {"edges": [[clean_text(s), clean_text(t), num(v)] for s, t, v in c.edges],
                          "faithfulness": num(c.faithfulness), "circuit_value": num(c.circuit_value),
                          "edges_scored": int(c.edges_scored), "steps": int(c.steps)}
    return out


def _header(data: dict) -> str:
    def e(text: str) -> str:
        return html.escape(visible_text(text))

    created = data["created"] or "unknown date"
    n = data["unknown"]
    unknown = f" ({n} of them unknown to the model)" if n else ""
    return (
        '<header class="al-head">'
        '<h1 class="al-title">Attention report '
        f'<span class="al-model">{e(data["model"])}</span></h1>'
        f'<p class="al-meta">{data["T"]} tokens{unknown}, {data["layers"]} layer(s) × {data["heads"]} '
        f'head(s), created <time>{e(created)}</time> by attnlab</p>'
        f'<p class="al-text"><span class="al-label">Text:</span> <q>{e(data["text"])}</q></p>'
        "</header>"
    )


def render_html(explanation: object, *, inline: bool = False, max_bytes: int | None = None) -> str:
    """The report of ``explanation`` as HTML.

    Args:
        explanation: an :class:`~attnlab.explain.Explanation`: ``tokens`` (``T`` str),
            ``attentions`` ``(layers, heads, T, T)`` in ``[0, 1]``, ``static`` ``(T, D)``,
            ``contextual`` ``(T, D')``, optional ``trace``.
        inline: give a fragment for a Jupyter output cell (no ``<html>``, no ids; several
            reports can share one page) instead of a whole page.
        max_bytes: the size to stay under (default :data:`MAX_BYTES`, 10 MB): when 8-bit
            attention codes would pass it, the codes get fewer levels (6, 5, 4, 3 or 2
            bits, the first that fits; a note says which).

    Returns:
        The HTML text. It loads nothing from the network.

    Raises:
        TypeError: ``explanation`` is not an Explanation or a field has the wrong type.
        ValueError: a field has the wrong shape, holds NaN/infinity, or the weights are
            outside ``[0, 1]``.

    Warns:
        UserWarning: more than ``LONG_INPUT`` tokens: the page shows ``WINDOW`` at a time;
            a page larger than ``max_bytes`` even with 2-bit attention codes.

    >>> from attnlab.explain import Explanation
    >>> rng = np.random.default_rng(0)
    >>> att = rng.dirichlet(np.ones(3), size=(1, 2, 3))           # (layers, heads, T, T)
    >>> e = Explanation("a <b> c", ["a", "<b>", "c"], "demo", att,
    ...                 rng.standard_normal((3, 4)), rng.standard_normal((3, 4)))
    >>> page = render_html(e)
    >>> page.startswith("<!DOCTYPE html>"), "<b>" in page, "&lt;b&gt;" in page
    (True, False, True)
    """
    return _page(_payload(explanation, max_bytes), inline=inline)


def _page(data: dict, *, inline: bool = False) -> str:
    """The HTML of the report's ``data`` (see :func:`render_html`)."""
    css = _asset("report.css")
    js = _asset("report.js")
    body = (
        '<div class="attnlab-report" data-format="1">'
        + _header(data)
        + '<div class="al-app"><p class="al-fallback">The interactive views need JavaScript'
        " (in Jupyter: trust the notebook).</p></div>"
        + '<script type="application/json" class="al-data">'
        + _json_for_script(data)
        + "</script></div>"
    )
    if inline:
        return f"<style>{css}</style>{body}<script>{js}</script>"
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = _CSP.format(script_hash=f"sha256-{digest}")
    title = html.escape(visible_text(f"attnlab report: {data['model']}"))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{title}</title><style>{css}</style></head><body>"
        f"{body}<script>{js}</script></body></html>\n"
    )


def write_report(explanation: object, path: str | os.PathLike, *, max_bytes: int | None = None) -> Path:
    """Write the report of ``explanation`` to ``path`` as one self-contained HTML file.

    The file is written next to ``path`` under a temporary name and moved into place, so a
    failure leaves no half-written report.

    Args:
        explanation: an :class:`~attnlab.explain.Explanation` (see :func:`render_html`).
        path: where to write, usually ``something.html``; the folder must exist.
        max_bytes: the size to stay under (see :func:`render_html`).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError, ValueError: as :func:`render_html`.
        OSError: the file cannot be written.

    >>> import tempfile, pathlib
    >>> from attnlab.explain import Explanation
    >>> att = np.full((1, 1, 2, 2), 0.5)
    >>> e = Explanation("hi there", ["hi", "there"], "demo", att, np.eye(2), np.eye(2))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = write_report(e, pathlib.Path(d) / "r.html")
    ...     p.name, "<script src" in p.read_text(encoding="utf-8")
    ('r.html', False)
    """
    page = render_html(explanation, max_bytes=max_bytes).encode("utf-8")
    return atomic_write(path, lambda tmp: tmp.write_bytes(page))
