"""The CPU description (presets, ATTNLAB_CPU, pinning) and the per-machine tuning figures:
measured once, kept in a cache file, and every bad file or folder ignored with one warning.

No test here measures anything: ``measure`` is replaced by a stub that counts its calls
(the one test of the real measurement drives it with a fake clock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

from attnlab import _cpu, _threads, _tuning
from attnlab._cpu import PRESETS, CPUInfo, _caches, cpu_info, describe_cpu, pinned_cpu
from attnlab._threads import available_cpus
from attnlab._tuning import TYPICAL, Profile, TuningCacheWarning, derive
from attnlab.core import dispatch, naive
from attnlab.core.spec import check_attention_args

# --------------------------------------------------------------------------- describing a CPU


def test_presets_and_fields():
    xeon = describe_cpu("xeon-avx512")
    assert (xeon.l1d, xeon.l2, xeon.l3) == (48 * 1024, 2 * 2**20, 260 * 2**20) and xeon.avx512f
    assert describe_cpu("avx2-512k").l2 == 512 * 1024 and not describe_cpu("avx2-512k").avx512f
    zen = describe_cpu("zen4,l2=2M,l3=64M")
    assert (zen.l2, zen.l3, zen.l1d, zen.avx512f) == (2 * 2**20, 64 * 2**20, 32 * 1024, True)
    own = describe_cpu("model=Mine,flags=avx2+fma,l1d=48K,l2=1280K,l3=30M")
    assert own.model == "Mine" and own.flags == {"avx2", "fma"} and own.l2 == 1280 * 1024 and own.from_os
    assert "described, not this machine: xeon-avx512" in xeon.describe()
    assert not describe_cpu("unknown").from_os


@pytest.mark.parametrize("text, match", [
    ("pentium", "unknown CPU preset 'pentium'; choose from avx2-512k"),
    ("zen4,l2", "'l2' is not a field of a CPU description"),
    ("zen4,cores=8", "'cores=8' is not a field"),
    ("l2=lots", "l2='lots' is not a cache size"),
    ("l2=0", "l2='0' is not a cache size"),
    (" , ", "an empty CPU description"),
])
def test_bad_descriptions(text, match):
    with pytest.raises(ValueError, match=match):
        describe_cpu(text)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONWARNINGS="default", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_attnlab_cpu_environment_variable():
    code = ("from attnlab._cpu import cpu_info\nfrom attnlab.core import rows\n"
            "print(cpu_info().l2, rows._block_bytes(), cpu_info().described)")
    res = _run(code, ATTNLAB_CPU="xeon-avx512")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(2 * 2**20), str(8 * 2**20), "xeon-avx512"]
    bad = _run(code, ATTNLAB_CPU="xeon-avx2048")
    assert bad.returncode == 0, bad.stderr
    assert bad.stdout.split()[0] == str(_cpu._os_cpu_info().l2)  # this machine's, after one warning
    assert bad.stderr.count("ATTNLAB_CPU ignored: unknown CPU preset 'xeon-avx2048'") == 1


def test_pinned_cpu_nests_and_holds_in_every_thread():
    seen = []
    with pinned_cpu("avx2-512k"):
        with pinned_cpu(PRESETS["xeon-avx512"]) as info:
            t = threading.Thread(target=lambda: seen.append(cpu_info()))
            t.start()
            t.join()
            assert seen == [info]
        assert cpu_info().l2 == 512 * 1024
    assert cpu_info() is _cpu._process_cpu_info()
    assert not cpu_info().described or os.environ.get("ATTNLAB_CPU")


def test_a_pinned_cpu_changes_the_decisions_at_once():
    q = np.zeros((3, 512, 16), np.float32)  # 3 MiB of scores: over twice a 1 MiB L2, under twice 2 MiB
    spec = check_attention_args(q, q, q)
    decisions = {}
    for name in PRESETS:
        with pinned_cpu(name):
            decisions[name] = dispatch.use_blockwise(spec)
    assert decisions == {"avx2-512k": True, "zen4": True, "xeon-avx512": False, "unknown": True}


def test_a_shared_l2_counts_per_cpu(tmp_path):
    def cache(n, level, kind, size, shared):
        d = tmp_path / f"index{n}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(value + "\n")

    cache(0, "1", "Data", "48K", "0,64")  # two hyperthreads on one core
    cache(1, "1", "Instruction", "32K", "0,64")
    cache(2, "2", "Unified", "2048K", "0-3")  # one L2 for a cluster of four small cores
    cache(3, "3", "Unified", "105M", "0-127")  # L3: the whole cache, shared
    assert _caches(tmp_path) == {"l1d": 24 * 1024, "l2": 512 * 1024, "l3": 105 * 2**20}
    (tmp_path / "index2" / "shared_cpu_list").write_text("garbage\n")
    assert _caches(tmp_path)["l2"] == 2 * 2**20  # unreadable: the size as given
    assert _cpu._cpu_count("0-3,8,10-11") == 7 and _cpu._cpu_count("") == 1


# --------------------------------------------------------------------------- the rule


def test_thresholds_follow_the_measured_figures():
    zen = PRESETS["zen4"]
    t = derive(TYPICAL, zen)
    assert (t.min_scores_per_thread, t.pool_matmul_min) == (2**18, 2**25)  # the hand-measured ones
    slow_pool = derive(Profile(4 * TYPICAL.pool_us, TYPICAL.gemm_gflops), zen)
    fast_core = derive(Profile(TYPICAL.pool_us, 4 * TYPICAL.gemm_gflops), zen)
    assert slow_pool.min_scores_per_thread == fast_core.min_scores_per_thread == 2**20
    assert slow_pool.pool_matmul_min == 2**27
    assert derive(Profile(0.001, 0.001), zen).min_scores_per_thread == 1
    assert derive(TYPICAL, PRESETS["xeon-avx512"]).transpose_copy_bytes == 24 * 1024
    assert "8 x the pool call" in "\n".join(t.lines())


# --------------------------------------------------------------------------- the cache file

FIGURES = Profile(123.0, 77.0, "stub")
CPUS = str(available_cpus())


@pytest.fixture
def tuning_env(tmp_path, monkeypatch):
    """Measuring on (ATTNLAB_TUNE=auto), the cache in a fresh folder, ``measure`` a stub:
    yields ``(folder, calls)``; what the process measured is forgotten before and after."""
    calls = []
    folder = tmp_path / "cache"
    monkeypatch.setenv("ATTNLAB_TUNE", "auto")
    monkeypatch.setenv("ATTNLAB_CACHE", str(folder))
    monkeypatch.delenv("ATTNLAB_CPU", raising=False)
    monkeypatch.setattr(_cpu, "_pinned", [])
    monkeypatch.setattr(_cpu, "_process_cpu_info", _cpu._os_cpu_info)
    monkeypatch.setattr(_tuning, "measure", lambda: calls.append(1) or FIGURES)
    _tuning.forget()
    yield folder, calls
    _tuning.forget()


def _figures(**kw):
    """The figures in force as a fresh process would find them, and its warnings."""
    _tuning.forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = _tuning.profile()
        _tuning.profile()  # asked again: neither measured nor warned again
        thr = _tuning.thresholds()
    return prof, thr, [str(w.message) for w in caught if issubclass(w.category, TuningCacheWarning)]


def test_measured_once_then_read_from_the_file(tuning_env):
    folder, calls = tuning_env
    prof, thr, warned = _figures()
    assert calls == [1] and not warned
    assert (prof.pool_us, prof.gemm_gflops) == (123.0, 77.0) and thr.profile is prof
    data = json.loads((folder / "tuning.json").read_text())
    assert data["format"] == 1 and data["key"] == _tuning.machine_key()
    assert list(data["profiles"]) == [str(available_cpus())]
    prof, _, warned = _figures()  # the next process
    assert calls == [1] and not warned and prof.source.startswith("measured, read from")
    assert (prof.pool_us, prof.gemm_gflops) == (123.0, 77.0)


def _good_file(folder) -> dict:
    _figures()
    return json.loads((folder / "tuning.json").read_text())


@pytest.mark.parametrize("case, match", [
    ("garbage bytes", "it is not JSON"),
    ("truncated", "it is not JSON"),
    ("a list", "not an attnlab tuning file of format 1"),
    ("format 99", "not an attnlab tuning file of format 1"),
    ("another CPU", "it was measured on another CPU"),
    ("negative figure", "pool_us is -5, not a number"),
    ("a bool figure", "gemm_gflops is True, not a number"),
    ("not a record", "are not a record"),
    ("huge", "larger than 65536 bytes"),
])
def test_a_bad_file_is_ignored_with_one_warning_and_measured_again(tuning_env, case, match):
    folder, calls = tuning_env
    data = _good_file(folder)
    path = folder / "tuning.json"
    text = json.dumps(data)
    if case == "garbage bytes":
        path.write_bytes(b"\xff\xfe\x00junk" * 10)
    elif case == "truncated":
        path.write_text(text[: len(text) // 2])
    elif case == "a list":
        path.write_text("[1, 2]")
    elif case == "format 99":
        path.write_text(json.dumps(dict(data, format=99)))
    elif case == "another CPU":
        data["key"]["cpu"] = dict(data["key"]["cpu"], model="Other CPU", l2=123)
        path.write_text(json.dumps(data))
    elif case == "negative figure":
        data["profiles"][CPUS]["pool_us"] = -5
        path.write_text(json.dumps(data))
    elif case == "a bool figure":
        data["profiles"][CPUS]["gemm_gflops"] = True
        path.write_text(json.dumps(data))
    elif case == "not a record":
        data["profiles"][CPUS] = [1, 2]
        path.write_text(json.dumps(data))
    elif case == "huge":
        path.write_text(" " * 70000 + text)
    calls.clear()
    prof, _, warned = _figures()
    assert calls == [1] and len(warned) == 1 and match in warned[0] and str(path) in warned[0]
    assert (prof.pool_us, prof.gemm_gflops) == (123.0, 77.0)
    assert json.loads(path.read_text())["key"] == _tuning.machine_key()  # rewritten, good again
    calls.clear()
    assert not _figures()[2] and calls == []


def test_other_library_versions_are_measured_again_silently(tuning_env):
    folder, calls = tuning_env
    data = _good_file(folder)
    data["key"]["numpy"] = "0.1"
    data["profiles"]["64"] = data["profiles"][CPUS]
    (folder / "tuning.json").write_text(json.dumps(data))
    calls.clear()
    assert not _figures()[2] and calls == [1]
    assert list(json.loads((folder / "tuning.json").read_text())["profiles"]) == [CPUS]  # the old ones dropped


def test_each_number_of_usable_cpus_keeps_its_own_figures(tuning_env):
    folder, calls = tuning_env
    _good_file(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_threads, "available_cpus", lambda: 64)  # e.g. under taskset, or a bigger share
        calls.clear()
        prof, _, warned = _figures()
        assert calls == [1] and not warned
    data = json.loads((folder / "tuning.json").read_text())
    assert sorted(data["profiles"]) == sorted([CPUS, "64"])
    calls.clear()
    prof, _, warned = _figures()
    assert not warned and calls == [] and prof.source.startswith("measured, read from")


@pytest.mark.parametrize("where", ["a file", "below a file", "read-only system folder", "an existing read-only folder",
                                   "the tuning file a folder"])
def test_a_cache_that_cannot_be_written_keeps_the_figures_in_memory(tuning_env, monkeypatch, tmp_path, where):
    _, calls = tuning_env
    if where == "a file":
        target = tmp_path / "plain-file"
        target.write_text("not a folder")
    elif where == "below a file":
        (tmp_path / "f").write_text("x")
        target = tmp_path / "f" / "cache"
    elif where == "the tuning file a folder":  # neither read nor replaced (root too may not)
        target = tmp_path / "cache"
        (target / "tuning.json").mkdir(parents=True)
    else:
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs /proc (a file system nobody may write)")
        target = "/proc/attnlab-cache" if where == "read-only system folder" else "/proc"
    monkeypatch.setenv("ATTNLAB_CACHE", str(target))
    prof, thr, warned = _figures()
    assert calls == [1] and len(warned) == 1, warned
    assert "ATTNLAB_CACHE" in warned[0] and "tuning kept in memory for this process" in warned[0]
    if where == "a file":
        assert f"ATTNLAB_CACHE={target} is a file, not a folder" in warned[0]
    elif where == "the tuning file a folder":
        assert f"tuning cache {target / 'tuning.json'} is ignored: it cannot be read" in warned[0]
        assert "and it cannot be rewritten" in warned[0] and prof.source.endswith("(cache not writable)")
        assert (target / "tuning.json").is_dir() and os.listdir(target) == ["tuning.json"]  # nothing left behind
    else:
        assert "cannot write its tuning cache" in warned[0] and prof.source.endswith("(cache not writable)")
    assert (prof.pool_us, thr.profile.gemm_gflops) == (123.0, 77.0)
    if where == "a file":
        assert target.read_text() == "not a folder"


def test_results_stay_right_whatever_the_cache_held(tuning_env):
    folder, _ = tuning_env
    data = _good_file(folder)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 3, 300, 64)).astype(np.float32)
    spec = check_attention_args(q, q, q, is_causal=True)
    want = naive.forward(spec)
    for pool_us in (1e-3, 1e5):  # every split, or none
        data["profiles"][CPUS]["pool_us"] = pool_us
        (folder / "tuning.json").write_text(json.dumps(data))
        _tuning.forget()
        from attnlab.core import blockwise as bw

        assert _tuning.profile().pool_us == pool_us
        assert bw.tuning().min_scores_per_thread == _tuning.thresholds().min_scores_per_thread
        got = dispatch.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert np.max(np.abs(got - want)) <= 1e-5


def test_described_cpus_and_tune_off_measure_nothing(tuning_env, monkeypatch):
    folder, calls = tuning_env
    with pinned_cpu("xeon-avx512"):
        assert _figures()[0] is TYPICAL
    monkeypatch.setenv("ATTNLAB_TUNE", "off")
    assert _figures()[0] is TYPICAL
    assert calls == [] and not folder.exists()


def test_cache_folder_follows_the_platform_conventions(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "mine"))
    assert _tuning.cache_path() == tmp_path / "mine" / "tuning.json"
    monkeypatch.delenv("ATTNLAB_CACHE")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _tuning.cache_folder() == tmp_path / "xdg" / "attnlab"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: ignored unless absolute
    assert _tuning.cache_folder().parts[-2:] == (".cache", "attnlab")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _tuning.cache_folder().parts[-3:] == ("Library", "Caches", "attnlab")
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert _tuning.cache_folder() == tmp_path / "local" / "attnlab" / "Cache"


def test_measuring_is_short_and_follows_its_clock():
    """The real measurement, driven by a fake clock: each timed call takes 1 ms of it."""
    now = [0.0]
    slept = []

    def clock():
        now[0] += 0.001  # each read 1 ms later: a timed call takes 1 ms
        return now[0]

    prof = _tuning.measure(2, clock=clock, sleep=slept.append)
    assert prof.pool_us == pytest.approx(1000.0)
    assert prof.gemm_gflops == pytest.approx(2 * 256**3 / 1e-3 / 1e9)
    assert len(slept) == 24 and sum(slept) <= 0.05  # the pauses: 48 ms in all
    assert _tuning.measure(1, clock=clock, sleep=slept.append).pool_us == TYPICAL.pool_us  # no pool


def test_importing_measures_nothing(tmp_path):
    code = ("import attnlab, attnlab.models.llama, attnlab.cli\nimport os\n"
            "print(os.path.exists(os.path.join(os.environ['ATTNLAB_CACHE'], 'tuning.json')))")
    res = _run(code, ATTNLAB_TUNE="auto", ATTNLAB_CACHE=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_cpu_info_from_the_os_is_read_once():
    assert _cpu._os_cpu_info() is _cpu._os_cpu_info()
    assert isinstance(_cpu._os_cpu_info(), CPUInfo)


def test_the_pool_is_measured_even_on_a_busy_machine(monkeypatch):
    """The busy-machine watch runs pool calls on their caller alone; the measurement of the
    pool's cost must still wake the pool (else it would measure nothing, and every later
    call would split)."""
    submits = []
    real = _threads._executor

    def counting(workers):
        ex = real(workers)

        class Counting:
            def submit(self, *args):
                submits.append(workers)
                return ex.submit(*args)

        return Counting()

    monkeypatch.setattr(_threads, "watch_the_machine", lambda: True)
    monkeypatch.setattr(_threads, "_executor", counting)
    _tuning.measure(2, sleep=lambda s: None)
    assert submits == [1] * 24  # each of the 24 timed calls woke the pool's worker
