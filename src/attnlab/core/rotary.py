"""Rotary position embedding (RoPE) as Hugging Face computes it, and its backward pass.

Axis legend: ``B`` batch, ``H`` heads, ``T`` positions, ``D`` head dim, ``R`` rotated dims
(``R <= D``, even; ``R = D`` unless a partial rotary factor is set), ``F = R / 2``
frequencies.

Convention (Hugging Face's, GPT-NeoX's): the rotated part of a head vector is split into
two **halves** ``x1 = x[..., :F]``, ``x2 = x[..., F:R]``; frequency ``f`` rotates the pair
``(x1[f], x2[f])``. Meta's original Llama code rotates interleaved pairs ``(x[2f], x[2f+1])``
instead; llama.cpp's GGUF files store q/k rows permuted so that its own kernels see the
halves layout (:mod:`attnlab.io.gguf` undoes that). In formulas::

    angle[t, f] = position[t] * inv_freq[f]
    cos = cat(cos(angle), cos(angle)) * attention_factor       # (..., T, R)
    sin = cat(sin(angle), sin(angle)) * attention_factor
    rotate_half(x) = cat(-x2, x1)
    rotary(x)[..., :R] = x[..., :R] * cos + rotate_half(x[..., :R]) * sin
    rotary(x)[..., R:] = x[..., R:]                            # partial rotary: unchanged

The inverse frequencies follow ``transformers.modeling_rope_utils`` for the scaling types
``default``, ``linear``, ``dynamic`` (NTK-aware, recomputed from the longest position seen
in the call), ``llama3`` and ``yarn`` (whose ``attention_factor`` scales cos and sin). As in
transformers, inverse frequencies and angles are float32 numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from attnlab._validation import positive_int, shape_error
from attnlab.core._namespace import namespace

__all__ = [
    "ROPE_TYPES",
    "RopeConfig",
    "apply_rotary",
    "apply_rotary_backward",
    "rope_cos_sin",
    "rope_inv_freq",
    "rotate_half",
]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """The parameters of a rotary embedding (Hugging Face's ``rope_parameters``).

    Attributes:
        head_dim: size of a head vector ``D``.
        theta: the base wavelength (``rope_theta``).
        rope_type: one of :data:`ROPE_TYPES`.
        partial_rotary_factor: the fraction of ``head_dim`` that is rotated (``R =
            int(head_dim * factor)``); ``None`` rotates all of it.
        factor: the scaling factor of ``linear``, ``dynamic``, ``llama3`` and ``yarn``.
        max_position_embeddings: the model's context (``dynamic`` scales past it; ``yarn``
            and ``llama3`` default ``original_max_position_embeddings`` to it).
        original_max_position_embeddings: the pretraining context (``llama3``, ``yarn``).
        low_freq_factor, high_freq_factor: ``llama3``'s band edges.
        beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: ``yarn``'s.

    >>> RopeConfig(64, theta=100000.0).rotary_dim
    64
    """

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float | None = None
    factor: float | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        positive_int(self.head_dim, "head_dim")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported types: "
                f"{', '.join(ROPE_TYPES)}"
            )
        if not (_number(self.theta) and math.isfinite(self.theta) and self.theta > 1):
            raise ValueError(f"rope_theta must be a finite number > 1, got {self.theta!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                     "partial_rotary_factor"):
            _check_number(name, getattr(self, name), positive=True)
        for name in ("mscale", "mscale_all_dim"):
            _check_number(name, getattr(self, name), positive=False)
        for name in ("max_position_embeddings", "original_max_position_embeddings"):
            value = getattr(self, name)
            if value is not None:
                positive_int(value, name)
        if self.partial_rotary_factor is not None and self.partial_rotary_factor > 1:
            raise ValueError(f"partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor!r}")
        if self.rope_type == "llama3" and None not in (self.low_freq_factor, self.high_freq_factor) \
                and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling high_freq_factor={self.high_freq_factor!r} must be larger than "
                             f"low_freq_factor={self.low_freq_factor!r}")
        needs = {
            "linear": ("factor",),
            "dynamic": ("factor", "max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",),
        }.get(self.rope_type, ())
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"rope_scaling type {self.rope_type!r} needs {', '.join(missing)}")
        if self.rope_type == "yarn" and self.factor is None and self.max_position_embeddings is None:
            raise ValueError("rope_scaling type 'yarn' needs factor (or max_position_embeddings)")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"the rotated part of a head (head_dim={self.head_dim} x partial_rotary_factor="
                f"{self.partial_rotary_factor}) must be an even number >= 2, got {self.rotary_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        """``R``: how many leading dims of a head are rotated."""
        if self.partial_rotary_factor is None:
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, config: Mapping, *, head_dim: int | None = None) -> RopeConfig:
        """Read a Hugging Face ``config.json`` dict: ``rope_theta`` and ``rope_scaling``
        (transformers 4) or ``rope_parameters`` (transformers 5), ``partial_rotary_factor``,
        ``head_dim`` (else ``hidden_size // num_attention_heads``), ``max_position_embeddings``.

        Raises:
            ValueError: an unsupported scaling type, named, with the supported ones.

        >>> RopeConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4,
        ...                     "rope_scaling": {"type": "linear", "factor": 2.0}}).factor
        2.0
        """
        params = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping) or not isinstance(params, Mapping):
            raise ValueError(f"rope_scaling must be a JSON object, got {scaling!r}")
        for key, value in scaling.items():
            params.setdefault(key, value)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        if head_dim is None:
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        max_pos = config.get("max_position_embeddings")
        original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        if rope_type in ("llama3", "yarn") and original is None:
            original = max_pos
        known = {f.name for f in fields(cls)}
        extra = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                                          "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                                          "truncate") if k in known and params.get(k) is not None}
        return cls(
            head_dim=int(head_dim), theta=float(theta) if _number(theta) else theta, rope_type=str(rope_type),
            partial_rotary_factor=None if partial is None or partial == 1.0 else float(partial),
            max_position_embeddings=max_pos, original_max_position_embeddings=original, **extra,
        )


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_number(name: str, value, *, positive: bool) -> None:
    """A rotary parameter that is None or a finite number (> 0 with ``positive``, else >= 0):
    a NaN, infinite, zero or negative factor would make every angle NaN."""
    if value is None:
        return
    ok = _number(value) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"rope_scaling {name} must be {need}, got {value!r}")


def _default_inv_freq(base, dim: int) -> np.ndarray:
    """``1 / base ** (arange(0, R, 2) / R)`` in float32 steps, as transformers computes it."""
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / _pow32(base, exponent)).astype(np.float32)


def _pow32(base, exponent) -> np.ndarray:
    """``base ** exponent`` of float32 numbers, correctly rounded to float32 (torch's float32
    pow agrees with this; NumPy's float32 power is off by an ulp in a few places)."""
    return np.power(np.float64(np.float32(base)), np.asarray(exponent, np.float64)).astype(np.float32)


def rope_inv_freq(config: RopeConfig, *, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)``: float32 ``(F,)`` inverse frequencies and the factor
    that scales cos and sin (1 except for ``yarn``).

    Args:
        config: the rotary parameters.
        seq_len: for ``dynamic``: the length the frequencies must reach (the largest position
            plus one); at or below ``max_position_embeddings`` the frequencies are the
            unscaled ones. Ignored by the other types.

    >>> inv, att = rope_inv_freq(RopeConfig(8, theta=10000.0))
    >>> inv.round(4), att
    (array([1.   , 0.1  , 0.01 , 0.001], dtype=float32), 1.0)
    """
    c = config
    dim = c.rotary_dim
    kind = c.rope_type
    if kind == "default":
        return _default_inv_freq(c.theta, dim), 1.0
    if kind == "linear":
        return (_default_inv_freq(c.theta, dim) / np.float32(c.factor)).astype(np.float32), 1.0
    if kind == "dynamic":
        n = c.max_position_embeddings if seq_len is None else max(int(seq_len), c.max_position_embeddings)
        grow = np.float32(c.factor) * np.float32(n) / np.float32(c.max_position_embeddings) - np.float32(c.factor - 1)
        base = np.float32(c.theta) * _pow32(grow, np.float32(dim / (dim - 2)))
        return _default_inv_freq(base, dim), 1.0
    if kind == "llama3":
        inv = _default_inv_freq(c.theta, dim)
        old = c.original_max_position_embeddings
        low_wavelen = old / c.low_freq_factor
        high_wavelen = old / c.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(c.factor), inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(c.low_freq_factor))
                  / np.float32(c.high_freq_factor - c.low_freq_factor)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / np.float32(c.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    factor = c.factor
    if factor is None:
        factor = c.max_position_embeddings / c.original_max_position_embeddings

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = c.attention_factor
    if attention is None:
        if c.mscale and c.mscale_all_dim:
            attention = float(mscale_of(factor, c.mscale) / mscale_of(factor, c.mscale_all_dim))
        else:
            attention = mscale_of(factor)
    beta_fast = c.beta_fast or 32
    beta_slow = c.beta_slow or 1

    def correction_dim(rotations):
        return (dim * math.log(c.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(c.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if c.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = _pow32(c.theta, np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (high frequencies), 0: interpolate
    inv = interpolation * (1 - keep) + extrapolation * keep
    return inv.astype(np.float32), float(attention)


def rope_cos_sin(
    inv_freq: np.ndarray, positions: np.ndarray, *, attention_factor: float = 1.0, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` of shape ``(..., T, R)`` for integer ``positions`` ``(T,)`` or ``(B, T)``.

    The angles ``position * inv_freq`` are float32 products (as in transformers); cos and
    sin are taken in float64 and rounded once to float32, then scaled by
    ``attention_factor`` (a float32 or narrower ``dtype``: transformers' numbers). For a
    float64 ``dtype`` they stay float64 (the float32 angles' exact cos and sin, scaled in
    float64): a float64 model keeps its precision after the angles.

    >>> cos, sin = rope_cos_sin(np.array([1.0, 0.5], dtype=np.float32), np.arange(3))
    >>> cos.shape, float(cos[0, 0]), float(sin[2, 0].round(4))
    ((3, 4), 1.0, 0.9093)
    """
    positions = np.asarray(positions)
    if not np.issubdtype(positions.dtype, np.integer):
        raise TypeError(f"positions must be an integer array, got dtype {positions.dtype}")
    if positions.ndim not in (1, 2):
        raise shape_error("positions", positions.shape, "(T,) or (B, T)")
    inv = np.asarray(inv_freq, dtype=np.float32)
    angles = positions.astype(np.float32)[..., None] * inv  # (..., T, F), float32 products
    emb = np.concatenate([angles, angles], axis=-1).astype(np.float64)  # (..., T, R)
    if np.dtype(dtype) == np.float64:
        return np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
    cos = np.cos(emb).astype(np.float32)
    sin = np.sin(emb).astype(np.float32)
    if attention_factor != 1.0:
        cos *= np.float32(attention_factor)
        sin *= np.float32(attention_factor)
    return cos.astype(dtype, copy=False), sin.astype(dtype, copy=False)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """``cat(-x2, x1)`` over the last axis, ``x1``/``x2`` its halves.

    >>> rotate_half(np.array([1.0, 2.0, 3.0, 4.0]))
    array([-3., -4.,  1.,  2.])
    """
    F = x.shape[-1] // 2
    return np.concatenate([-x[..., F:], x[..., :F]], axis=-1)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, sign: float) -> np.ndarray:
    R = cos.shape[-1]
    D = x.shape[-1]
    if R > D or R % 2:
        raise shape_error("cos", cos.shape, f"(..., R) with R even and <= the head dim {D}")
    if cos.shape != sin.shape:
        raise shape_error("sin", sin.shape, f"the shape of cos {tuple(cos.shape)}")
    F = R // 2
    if type(x) is not np.ndarray:  # another library's arrays (cos and sin in its dtype): the same products
        x1, x2 = x[..., :F], x[..., F:R]
        c1, c2, s1, s2 = cos[..., :F], cos[..., F:], sin[..., :F], sin[..., F:]
        if sign > 0:  # without the sign's products: each is a kernel launch on a GPU
            parts = [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
        else:
            parts = [x1 * c1 + x2 * s1, x2 * c2 - x1 * s2]
        return namespace(x).concat(parts + [x[..., R:]] if R < D else parts, axis=-1)
    out = _rotate_compiled(x, cos, sin, sign)
    if out is not None:
        return out
    xr = x[..., :R]
    out = np.empty(np.broadcast_shapes(x.shape[:-1] + (R,), cos.shape)[:-1] + (D,), dtype=x.dtype)
    # out1 = x1 cos1 - s x2 sin1 ; out2 = x2 cos2 + s x1 sin2   (s = +1 forward, -1 transpose)
    x1, x2 = xr[..., :F], xr[..., F:]
    out[..., :F] = x1 * cos[..., :F] - sign * x2 * sin[..., :F]
    out[..., F:R] = x2 * cos[..., F:] + sign * x1 * sin[..., F:]
    if R < D:
        out[..., R:] = x[..., R:]
    return out


# float32 rotations of at least this many elements run on the compiled loop (numba
# installed): SmolLM2's prefill at 512 tokens spent 40 ms of ~850 in the NumPy path's
# eight passes and temporaries. The same numbers bit for bit.
_COMPILED_MIN = 1 << 16


def _rotate_compiled(x, cos, sin, sign: float) -> np.ndarray | None:
    """:func:`_rotate` on :func:`attnlab.core._fused.rotate32`, or None where it does not
    apply: float32 NumPy arrays, ``x (N, H, T, D)``, ``cos``/``sin`` ``(T, R)`` or ``(N or 1,
    1, T, R)`` (the shapes the rotary layer passes), enough elements, compiled kernels
    available and not turned off."""
    if type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim != 4 or x.size < _COMPILED_MIN \
            or type(cos) is not np.ndarray or cos.dtype != np.float32 or sin.dtype != np.float32:
        return None
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    elif cos.ndim == 4 and cos.shape[1] == 1 and cos.shape[0] in (1, x.shape[0]):
        cos, sin = cos[:, 0], sin[:, 0]
    else:
        return None
    if cos.shape[1] != x.shape[2]:
        return None
    from attnlab.core.blockwise import fused_planned

    if not fused_planned(np.float32, x.size, min_n=_COMPILED_MIN):
        return None
    from attnlab.core import _fused  # imports numba

    out = np.empty(x.shape, dtype=np.float32)
    _fused.rotate32(x, cos, sin, np.float32(sign), out)
    return out


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the first ``R`` dims of ``x`` ``(..., T, D)`` by ``cos``/``sin`` ``(..., T, R)``
    (broadcast against ``x``: for ``x`` ``(B, H, T, D)`` pass ``cos[:, None]`` from batched
    positions); the remaining ``D - R`` dims pass through. Equal to transformers'
    ``q * cos + rotate_half(q) * sin``.

    >>> cos, sin = rope_cos_sin(np.array([1.0], dtype=np.float32), np.arange(2))
    >>> apply_rotary(np.ones((2, 2), np.float32), cos, sin).round(4)
    array([[ 1.    ,  1.    ],
           [-0.3012,  1.3818]], dtype=float32)
    """
    return _rotate(x, cos, sin, 1.0)


def apply_rotary_backward(grad_output: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """dLoss/dx of :func:`apply_rotary` (the transposed rotation: ``g cos - rotate_half(g sin)``);
    ``cos``/``sin`` must have the shape used in the forward pass.

    >>> cos, sin = rope_cos_sin(np.array([1.0], dtype=np.float32), np.arange(2))
    >>> x = np.ones((2, 2), np.float32)
    >>> np.allclose(apply_rotary_backward(apply_rotary(x, cos, sin), cos, sin), x)
    True
    """
    return _rotate(grad_output, cos, sin, -1.0)
