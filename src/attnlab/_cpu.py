"""What the CPU is: its model name, the ISA flags that matter for speed, its cache sizes.

Read once from the operating system (Linux: ``/proc/cpuinfo`` and
``/sys/devices/system/cpu/cpu0/cache``); anything that cannot be read falls back to a
typical x86-64 value, so nothing here ever fails. The kernels size their blocks from these
numbers (:mod:`attnlab._tuning`) and ``attnlab bench`` prints them.

L1d and L2 are per core: where the OS says that several CPUs share one cache (an L2 shared
by two hyperthreads, or by a cluster of small cores), each CPU counts its share of it, since
each of attnlab's threads runs on one of them. ``lscpu`` prints the sum over all instances
instead ("L2: 2 MiB (2 instances)" is 1 MiB a core). L3 is the whole shared cache.

Another machine's description can stand in for this one's (to see what attnlab would
decide there, or to run the test suite as that machine would): set ``ATTNLAB_CPU`` to a
preset name (:data:`PRESETS`), to ``key=value`` fields (``model=...,flags=avx2+avx512f,
l1d=48K,l2=2M,l3=260M``) or to a preset followed by fields that change it
(``xeon-avx512,l2=1M``); in code, :func:`pinned_cpu`. A value that cannot be read is
ignored with a warning. A described CPU changes decisions only, never the instructions
run (numba and BLAS still see the real one), and is never measured
(:mod:`attnlab._tuning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import threading
import warnings
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
    described: str = ""  # where it is not this machine's: the ATTNLAB_CPU value or pinned_cpu() argument

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
        if self.described:
            note = f" (described, not this machine: {self.described})"
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


def _cpu_count(cpu_list: str | None) -> int:
    """How many CPUs a sysfs list such as ``0-3,8`` names (1 for what cannot be read)."""
    n = 0
    for part in (cpu_list or "").strip().split(","):
        lo, _, hi = part.partition("-")
        try:
            n += int(hi) - int(lo) + 1 if hi else (1 if lo.strip() else 0)
        except ValueError:
            return 1
    return max(n, 1)


def _caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    """``{"l1d": bytes, "l2": ..., "l3": ...}`` for what the OS reports; L1d and L2 per CPU
    (a cache that ``shared_cpu_list`` says several CPUs share counts its share)."""
    found: dict[str, int] = {}
    for index in sorted(root.glob("index*")):
        level = (_read(index / "level") or "").strip()
        kind = (_read(index / "type") or "").strip()
        size = _parse_size(_read(index / "size") or "")
        if size is None or kind == "Instruction":
            continue
        name = {"1": "l1d", "2": "l2", "3": "l3"}.get(level)
        if name in ("l1d", "l2"):
            size //= _cpu_count(_read(index / "shared_cpu_list"))
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


_AVX2 = frozenset("sse4_2 avx fma avx2 bmi2".split())
_AVX512 = _AVX2 | frozenset("avx512f avx512dq avx512bw avx512vl avx512_vnni".split())

# Machines whose descriptions stand in for this one (ATTNLAB_CPU, pinned_cpu): the three the
# test suite is run as, and a machine with no cache information at all.
PRESETS: dict[str, CPUInfo] = {
    "avx2-512k": CPUInfo("x86-64 AVX2, 512 KiB L2 (preset avx2-512k)", _AVX2, 32 * 1024, 512 * 1024,
                         32 * 2**20, True),
    "zen4": CPUInfo("AMD EPYC Zen 4 (preset zen4)", _AVX512, 32 * 1024, 2**20, 32 * 2**20, True),
    "xeon-avx512": CPUInfo("Intel Xeon AVX-512 (preset xeon-avx512)", _AVX512, 48 * 1024, 2 * 2**20,
                           260 * 2**20, True),
    "unknown": CPUInfo("unknown CPU (preset unknown)", frozenset(), _DEFAULT_L1D, _DEFAULT_L2, _DEFAULT_L3, False),
}

_FIELDS = ("model", "flags", "l1d", "l2", "l3")


def describe_cpu(text: str) -> CPUInfo:
    """The :class:`CPUInfo` that ``text`` describes: a preset name (:data:`PRESETS`),
    ``key=value`` fields separated by commas (``model``, ``flags`` joined by ``+``,
    ``l1d``, ``l2``, ``l3`` with an optional K/M/G suffix), or a preset then fields.
    Fields left out are the preset's (or, without one, this machine's).

    >>> describe_cpu("xeon-avx512").l2 // 1024
    2048
    >>> info = describe_cpu("zen4,l2=512K,flags=avx2")
    >>> info.l2 // 1024, info.avx512f, info.described
    (512, False, 'zen4,l2=512K,flags=avx2')

    Raises:
        ValueError: an unknown preset or field, a size that is not one.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("an empty CPU description")
    base = None
    if "=" not in parts[0]:
        name = parts.pop(0).lower()
        if name not in PRESETS:
            raise ValueError(f"unknown CPU preset {name!r}; choose from {', '.join(PRESETS)} or give "
                             f"fields ({', '.join(_FIELDS)})")
        base = PRESETS[name]
    fields: dict = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or key not in _FIELDS:
            raise ValueError(f"{part!r} is not a field of a CPU description; use key=value with key one of "
                             f"{', '.join(_FIELDS)}")
        if key == "model":
            fields[key] = value
        elif key == "flags":
            fields[key] = frozenset(f for f in value.replace("+", " ").split())
        else:
            size = _parse_size(value)
            if size is None or size <= 0:
                raise ValueError(f"{key}={value!r} is not a cache size (bytes, or a number with K, M or G)")
            fields[key] = size
    info = base if base is not None else dataclasses.replace(_os_cpu_info(), model="described CPU", from_os=True)
    return dataclasses.replace(info, **fields, described=text.strip())


_pinned: list[CPUInfo] = []  # pinned_cpu()'s stack; the last one is in force
_pin_lock = threading.Lock()


@contextlib.contextmanager
def pinned_cpu(cpu: CPUInfo | str):
    """Inside the ``with`` block, :func:`cpu_info` answers ``cpu`` (a :class:`CPUInfo`, or a
    description as :func:`describe_cpu` reads it) in every thread: for tests that reason
    about a decision taken from the CPU, and for seeing what another machine would decide.

    >>> with pinned_cpu("avx2-512k"):
    ...     cpu_info().l2 // 1024
    512
    """
    info = describe_cpu(cpu) if isinstance(cpu, str) else cpu
    with _pin_lock:
        _pinned.append(info)
    try:
        yield info
    finally:
        with _pin_lock:
            _pinned.remove(info)


def cpu_info() -> CPUInfo:
    """The CPU attnlab decides for: :func:`pinned_cpu`'s inside its block, else the one
    ``ATTNLAB_CPU`` describes, else this machine's (read once, then cached).

    >>> info = cpu_info()
    >>> info.l2 > 0 and info.l1d > 0
    True
    """
    if _pinned:
        return _pinned[-1]
    return _process_cpu_info()


def is_described() -> bool:
    """True when :func:`cpu_info` is not this machine's own (pinned or ``ATTNLAB_CPU``).

    >>> with pinned_cpu("zen4"):  # the same whatever ATTNLAB_CPU says
    ...     is_described()
    True
    """
    return bool(cpu_info().described)


@functools.cache
def _process_cpu_info() -> CPUInfo:
    text = os.environ.get("ATTNLAB_CPU", "").strip()
    if text:
        try:
            return describe_cpu(text)
        except ValueError as exc:
            warnings.warn(f"ATTNLAB_CPU ignored: {exc}; deciding for this machine's CPU", RuntimeWarning,
                          stacklevel=3)
    return _os_cpu_info()


@functools.cache
def _os_cpu_info() -> CPUInfo:
    """This machine's CPU, as the operating system describes it."""
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
