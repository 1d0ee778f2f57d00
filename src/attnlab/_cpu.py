"""What the CPU is: its model name, the ISA flags that matter for speed, its cache sizes.

Read once from the operating system (Linux: ``/proc/cpuinfo`` and
``/sys/devices/system/cpu/cpu0/cache``); anything that cannot be read falls back to a
typical x86-64 value, so nothing here ever fails. The blockwise kernel sizes its tiles from
these numbers (:func:`attnlab.core.blockwise.tuning`) and ``attnlab bench`` prints them.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# Fallbacks when the OS does not say: a common x86-64 server core.
_DEFAULT_L1D = 32 * 1024
_DEFAULT_L2 = 1024 * 1024
_DEFAULT_L3 = 32 * 1024 * 1024

_SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


@dataclass(frozen=True)
class CPUInfo:
    """The CPU attnlab runs on (all cache sizes in bytes, per core for L1 and L2)."""

    model: str
    flags: frozenset
    l1d: int
    l2: int
    l3: int
    from_os: bool  # False when the cache sizes are fallbacks

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512f(self) -> bool:
        return "avx512f" in self.flags

    def describe(self) -> str:
        """One line: model, the SIMD flags, the caches.

        >>> CPUInfo("X", frozenset({"avx2"}), 32768, 524288, 2**25, True).describe()
        'X; avx2 yes, avx512f no; L1d 32 KiB, L2 512 KiB, L3 32 MiB per core/shared'
        """
        note = "" if self.from_os else " (not reported by the OS: typical values)"
        return (
            f"{self.model}; avx2 {'yes' if self.avx2 else 'no'}, "
            f"avx512f {'yes' if self.avx512f else 'no'}; L1d {_kib(self.l1d)}, "
            f"L2 {_kib(self.l2)}, L3 {_kib(self.l3)} per core/shared{note}"
        )


def _kib(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 and n % 2**20 == 0 else f"{n // 1024} KiB"


def _parse_size(text: str) -> int | None:
    text = text.strip().upper()
    if not text:
        return None
    unit = _SIZE_UNITS.get(text[-1], 1)
    digits = text[:-1] if text[-1] in _SIZE_UNITS else text
    try:
        return int(digits) * unit
    except ValueError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    """``{"l1d": bytes, "l2": ..., "l3": ...}`` for what the OS reports."""
    found: dict[str, int] = {}
    for index in sorted(root.glob("index*")):
        level = (_read(index / "level") or "").strip()
        kind = (_read(index / "type") or "").strip()
        size = _parse_size(_read(index / "size") or "")
        if size is None or kind == "Instruction":
            continue
        name = {"1": "l1d", "2": "l2", "3": "l3"}.get(level)
        if name:
            found[name] = size
    return found


def _cpuinfo(text: str | None) -> tuple[str, frozenset]:
    model, flags = "", frozenset()
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.cache
def cpu_info() -> CPUInfo:
    """The CPU this process runs on (read once, then cached).

    >>> info = cpu_info()
    >>> info.l2 > 0 and info.l1d > 0
    True
    """
    model, flags = _cpuinfo(_read(Path("/proc/cpuinfo")))
    caches = _caches()
    return CPUInfo(
        model=model or platform.processor() or platform.machine() or "unknown CPU",
        flags=flags,
        l1d=caches.get("l1d", _DEFAULT_L1D),
        l2=caches.get("l2", _DEFAULT_L2),
        l3=caches.get("l3", _DEFAULT_L3),
        from_os="l2" in caches,
    )
