"""Sweep engines side by side: the logit lens of SmolLM2 (the likeliest next tokens after
every block, at each prompt's last token) over prompts of 16-64 tokens, on the serial
engine, 2 worker processes, a local Ray cluster and a Ray cluster given by address.

    python benchmarks/sweep.py                      # 1000 prompts, every engine, once
    python benchmarks/sweep.py --prompts 300 --repeat 2 --engines serial,processes

Prints, per engine and round, the steady rate (prompts per second between the first and
the last batch, model loading not counted), its ratio to serial's in the same round, and
for the process engine each worker's peak memory (from /proc/PID/smaps_rollup: RSS, PSS,
which counts the memory-mapped weights once across the processes that share them, and
USS, the worker's own pages). Then the resume check: a process-engine sweep killed
(SIGKILL) when about half its prompts are recorded, and run again to the end: the prompts
that went through the model in both runs, against one run's. Rounds interleave the engines
so that a busy machine disturbs each alike; the table names the CPU and the load. A
benchmark, not a test: it never fails on a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _setup import machine_load  # noqa: E402

from attnlab.sweep.methods import LogitLensTop  # noqa: E402

ENGINES = ("serial", "processes", "ray", "ray-address")
# Both Ray clusters stay on 127.0.0.1 and run without token authentication: a process that
# started a token-authenticated local cluster cannot then use one without (and the reverse).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def make_prompts(path: Path, n: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            ids = rng.integers(100, 40000, int(rng.integers(16, 65))).tolist()  # 16-64 tokens
            fh.write(json.dumps({"text": ids}) + "\n")


def _children() -> list[int]:
    """This process's worker processes (multiprocessing's resource tracker left out)."""
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    workers = []
    for pid in out:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmd:
            workers.append(pid)
    return workers


def _rollup(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            name, value, *_ = line.split()
            fields[name.rstrip(":")] = int(value) * 1024
    except (OSError, ValueError):
        return {}
    return {"rss": fields.get("Rss", 0), "pss": fields.get("Pss", 0),
            "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)}


class MemorySampler(threading.Thread):
    """Peak RSS, PSS and USS of each worker process, sampled every 0.5 s. Reading smaps_rollup
    walks the worker's page tables under its memory-map lock, which slows the worker: the
    memory is measured in a run of its own, never in a timed one."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: dict[int, dict[str, int]] = {}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            for pid in _children():
                m = _rollup(pid)
                if m:
                    p = self.peak.setdefault(pid, dict.fromkeys(m, 0))
                    for k, v in m.items():
                        p[k] = max(p[k], v)


class RayHead:
    """A one-node Ray cluster on 127.0.0.1 (``ray start --head --block`` in its own process
    group), stopped by signalling that group alone."""

    def __enter__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
        ray = Path(sys.executable).with_name("ray")
        self.proc = subprocess.Popen([str(ray), "start", "--head", f"--port={self.port}",
                                      "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
                                      "--disable-usage-stats", "--block"], env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(60):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        time.sleep(2)
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return False


def run_engine(engine: str, data: Path, out: Path, args, *, memory: bool = False) -> dict:
    from attnlab.sweep import sweep

    marks: list[tuple[float, int]] = []

    def progress(p):
        marks.append((time.perf_counter(), p.computed))

    kwargs = {"engine": "ray" if engine.startswith("ray") else engine, "workers": args.workers}
    if engine == "serial":
        kwargs["workers"] = None
    sampler = MemorySampler() if memory else None
    if sampler:
        sampler.start()
    try:
        if engine == "ray-address":
            with RayHead() as address:
                report = sweep("smollm2", data, out, method="logit_lens_top", options={"k": args.k, "position": -1},
                               progress=progress, address=address, **kwargs)
        else:
            report = sweep("smollm2", data, out, method="logit_lens_top", options={"k": args.k, "position": -1},
                           progress=progress, **kwargs)
    finally:
        if sampler:
            sampler.stop.set()
            sampler.join()
    (t0, n0), (t1, n1) = marks[0], marks[-1]
    return {"rate": (n1 - n0) / (t1 - t0), "load": report.load_seconds, "seconds": report.seconds,
            "memory": list(sampler.peak.values()) if sampler else None}


# ---- the resume check: a sweep killed at about half, run again --------------------------------

class CountingLens(LogitLensTop):
    """The logit lens, counting in a file every prompt that goes through the model (the
    workers import this class from this script by name)."""

    def __init__(self, counter: str, **options):
        super().__init__(**options)
        self.counter = counter

    def __call__(self, model, batch):
        fd = os.open(self.counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{len(batch)}\n".encode())
        finally:
            os.close(fd)
        return super().__call__(model, batch)


def resume_child(data: str, out: str, counter: str, k: int, workers: int) -> None:
    from attnlab.sweep import sweep

    sweep("smollm2", data, out, method=CountingLens(counter, k=k, position=-1), engine="processes",
          workers=workers, progress=lambda p: print(p.done, p.total, flush=True))


def resume_check(data: Path, folder: Path, n: int, args) -> dict:
    counter = folder / "counter.txt"
    out = folder / "resume"
    cmd = [sys.executable, __file__, "--resume-child", str(data), str(out), str(counter), str(args.k),
           str(args.workers)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    killed_at = None
    for line in child.stdout:
        done = int(line.split()[0])
        if done >= n // 2:
            os.killpg(child.pid, signal.SIGKILL)  # the driver and its workers, at once
            killed_at = done
            break
    child.wait()
    first = sum(int(x) for x in counter.read_text().split())
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    total = sum(int(x) for x in counter.read_text().split())
    from attnlab.sweep import read_results

    r = read_results(out)
    return {"killed_at": killed_at, "first": first, "second": total - first, "total": total, "ok": int(r.ok.sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--no-resume", action="store_true", help="skip the resume check")
    p.add_argument("--resume-only", action="store_true", help="only the resume check")
    p.add_argument("--resume-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.resume_child:
        data, out, counter, k, workers = args.resume_child
        resume_child(data, out, counter, int(k), int(workers))
        return
    from attnlab._cpu import cpu_info

    engines = [] if args.resume_only else args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "prompts.jsonl"
        make_prompts(data, args.prompts)
        print(f"CPU: {cpu_info().model}, {len(os.sched_getaffinity(0))} usable; load {machine_load()}")
        print(f"SmolLM2 logit lens (k={args.k}, last token) over {args.prompts} prompts of 16-64 tokens; "
              f"{args.workers} workers, 1 thread each\n")
        if engines:
            print(f"{'round':>5}  {'engine':<12} {'prompts/s':>9} {'x serial':>8} {'load s':>7} {'total s':>8}")
        rates: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(args.repeat):
            base = None
            for engine in engines:
                res = run_engine(engine, data, tmp / f"{engine}-{r}", args)
                rates[engine].append(res["rate"])
                base = res["rate"] if engine == "serial" else base
                ratio = f"{res['rate'] / base:.2f}" if base else "-"
                print(f"{r + 1:>5}  {engine:<12} {res['rate']:9.2f} {ratio:>8} {res['load']:7.1f} "
                      f"{res['seconds']:8.1f}", flush=True)
        if "serial" in rates and len(rates["serial"]) == args.repeat:
            print("\nratio to serial, per round (min - max):")
            for engine in engines:
                ratios = [a / b for a, b in zip(rates[engine], rates["serial"], strict=True)]
                print(f"  {engine:<12} {min(ratios):.2f} - {max(ratios):.2f}")
        if "processes" in engines:
            memory = run_engine("processes", data, tmp / "memory", args, memory=True)["memory"]
            gb = 1e9
            print("\nprocess workers, peak memory each (GB, a run of its own): "
                  + "; ".join(f"RSS {m['rss'] / gb:.2f}, PSS {m['pss'] / gb:.2f}, USS {m['uss'] / gb:.2f}"
                              for m in memory))
        if not args.no_resume:
            res = resume_check(data, tmp, args.prompts, args)
            print(f"\nresume: killed with {res['killed_at']} of {args.prompts} prompts recorded; prompts through "
                  f"the model: {res['first']} before the kill + {res['second']} after = {res['total']} "
                  f"({100 * res['total'] / args.prompts:.1f}% of one run); {res['ok']} results recorded")
        print(f"\nload at the end: {machine_load()}")


if __name__ == "__main__":
    main()
