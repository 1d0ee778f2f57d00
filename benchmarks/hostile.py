"""Hostile files and inputs against attnlab, each in its own process: does it refuse them
with a named error, within 5 s and 300 MB above the import's baseline?

    python benchmarks/hostile.py [--only SUBSTRING] [--keep DIR]

The files are built from the bundled SmolLM2 GGUF file (G) and from tiny decoder folders
(the builders are the tests' own, tests/hostile_files.py). Each case runs in a fresh
process: ``from_pretrained`` of the file (its logits checked when it loads), a chat
template rendered, greedy decoding of NaN logits, or the ``attnlab`` command with its
output sent to a full disk or a path that is not a regular file. The table gives the
outcome, the seconds and the peak resident memory above the process's baseline after its
imports. Memory and time are the machine's of the moment (say so beside any figure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

LIMIT_S, LIMIT_MB, HANG_S = 5.0, 300.0, 15.0

# ---- what runs in the child process ----------------------------------------------------------
CHILD = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
import numpy as np
import gguf, tokenizers, jinja2  # noqa: F401  (the baseline holds the readers)
import attnlab.models.llama  # noqa: F401
from attnlab.models.registry import from_pretrained

def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

with open("/proc/self/clear_refs", "w") as f:  # the peak from here on (a fork inherits its parent's)
    f.write("5")
base = rss_mb("VmRSS")
out = {"base_mb": base}
start = time.perf_counter()
try:
    if spec["kind"] == "load":
        model = from_pretrained(spec["path"])
        logits = model(np.array([[1, 2, 3]]))
        out["outcome"] = "loaded, logits " + ("finite" if np.isfinite(logits).all() else "NOT finite")
        if getattr(model, "tokenizer", None) is not None:
            ids = model.generate(np.array([1, 2, 3]), 4)
            text = model.tokenizer.decode(ids[3:].tolist())
            out["outcome"] += f", 4 new tokens decode to {text!r}"
    elif spec["kind"] == "template":
        from attnlab.text.chat import ChatTemplate
        text = ChatTemplate(spec["source"]).render([{"role": "user", "content": "hi"}])
        out["outcome"] = f"rendered {len(text)} characters"
    elif spec["kind"] == "greedy_nan":
        from attnlab.models.gpt2 import GPT2, GPT2Config
        model = GPT2(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2),
                     rng=np.random.default_rng(0))
        model.ln_f.weight.data[:] = np.nan
        ids = model.generate(np.array([1, 2, 3]), 3)
        out["outcome"] = f"generated {ids[3:].tolist()}"
except BaseException as exc:  # what escapes is the point of the check
    out["outcome"] = "raised"
    out["type"] = type(exc).__module__ + "." + type(exc).__qualname__
    out["mro"] = [c.__name__ for c in type(exc).__mro__]
    out["message"] = str(exc)[:300]
out["seconds"] = time.perf_counter() - start
out["peak_mb"] = rss_mb("VmHWM")
print("RESULT " + json.dumps(out))
"""


def run_child(spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                              env=env, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        return {"outcome": f"no answer within {HANG_S:g} s (killed)", "pass": False}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"outcome": f"died (exit {proc.returncode}): {proc.stderr.strip()[-200:]}", "pass": False}
    out = json.loads(line[7:])
    out["above_mb"] = out["peak_mb"] - out["base_mb"]
    return out


def judge_refusal(out: dict, where: str | None) -> dict:
    """Refused: a CheckpointError (a ValueError subclass) naming the file ``where``, or for
    a template (``where`` None) a ValueError, within the time and memory limits."""
    named = out.get("outcome") == "raised" and "ValueError" in out.get("mro", []) and (
        where is None or (out["type"].split(".")[-1] != "ValueError" and where in out["message"]))
    out["pass"] = bool(named and out["seconds"] <= LIMIT_S and out["above_mb"] <= LIMIT_MB)
    return out


def run_cli(argv: list[str], *, stdout_path: str | None = None, check=None) -> dict:
    """The console script: exit 2 and one line on stderr, no traceback."""
    exe = Path(sys.executable).parent / "attnlab"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), LC_ALL="C.UTF-8", NO_COLOR="1")
    start = time.perf_counter()
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL
    try:
        proc = subprocess.run([str(exe), *argv], stdout=out, stderr=subprocess.PIPE, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return {"outcome": "no answer within 120 s", "pass": False}
    finally:
        if stdout_path:
            out.close()
    err = proc.stderr.decode("utf-8", "replace").strip()
    lines = err.splitlines()
    ok = proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err and (check is None or check())
    shown = lines[0] if len(lines) == 1 else f"{len(lines)} lines: ... {lines[-1] if lines else ''}"
    return {"outcome": f"exit {proc.returncode}; {shown}", "seconds": time.perf_counter() - start, "pass": ok}


# ---- the cases ---------------------------------------------------------------------------------
def cases(g: Path, tmp: Path):
    """``(group, name, thunk)``: the thunk builds the input and returns the judged result."""
    import gguf

    from hostile_files import (
        DROP,
        cut,
        nested_array,
        patch,
        rewrite_gguf,
        small_vocabulary,
        tensor_info_at,
        write_hf_decoder,
    )


    def load(path, where=None):
        return judge_refusal(run_child({"kind": "load", "path": str(path)}), str(path) if where is None else where)

    def meta(name, **changes):
        def thunk():
            return load(rewrite_gguf(g, tmp / f"{name}.gguf", metadata={k.replace("__", "."): v
                                                                      for k, v in changes.items()}))
        return thunk

    def folder(name, **changes):
        def thunk():
            return load(write_hf_decoder(tmp / name, **changes))
        return thunk

    def template(source):
        def thunk():
            out = run_child({"kind": "template", "source": source})
            out["above_mb"] = out.get("above_mb", 0)
            return judge_refusal(out, None) if "seconds" in out else out
        return thunk

    info = tensor_info_at(g, 0)
    size = g.stat().st_size
    rows = [
        # 1. sizes that hang or exhaust memory
        ("1 sizes", "G block_count 10**9", meta("blocks", llama__block_count=10**9)),
        ("1 sizes", "folder num_hidden_layers 10**9", folder("layers", num_hidden_layers=10**9)),
        ("1 sizes", "G embedding_length 2**40", meta("width", llama__embedding_length=2**40)),
        ("1 sizes", "G feed_forward_length 2**40", meta("ffn", llama__feed_forward_length=2**40)),
        ("1 sizes", "G vocab_size 2**40", meta("vocab", llama__vocab_size=2**40)),
        # 2. what the header alone reveals
        ("2 header", "G token_embd.weight renamed", lambda: load(rewrite_gguf(
            g, tmp / "renamed.gguf", tensors={"token_embd.weight": "token_embd.weight_renamed"}))),
        ("2 header", "G rope.freq_base -10000", meta("theta_neg", llama__rope__freq_base=-10000.0)),
        ("2 header", "G rope.freq_base NaN", meta("theta_nan", llama__rope__freq_base=float("nan"))),
        ("2 header", "G tokenizer.ggml.model 'bert'", meta("bert", tokenizer__ggml__model="bert")),
        ("2 header", "G 10 heads over 576", meta("heads10", llama__attention__head_count=10)),
        ("2 header", "G 2 key/value heads", meta("kv2", llama__attention__head_count_kv=2)),
        # 3. errors that escaped unnamed
        ("3 unnamed", "G metadata array nested 3000 deep", lambda: load(nested_array(g, tmp / "nested.gguf", 3000))),
        ("3 unnamed", "G merges without a space", lambda: load(rewrite_gguf(
            g, tmp / "merges.gguf", metadata={"tokenizer.ggml.merges": ["ab", "cd"]}))),
        ("3 unnamed", "G a merge naming a token outside the vocabulary", lambda: load(rewrite_gguf(
            g, tmp / "merges2.gguf", metadata={"tokenizer.ggml.merges": ["Ġ t", "zzzq xxxw"]}))),
        ("3 unnamed", "G eos_token_id a string", meta("eos", tokenizer__ggml__eos_token_id="two")),
        ("3 unnamed", "folder: a safetensors tensor [0, 2**63]", lambda: _bigdim(tmp, write_hf_decoder, load)),
        # 4. files that loaded but were wrong
        ("4 wrong", "G 1000 tokens for 49152 rows", lambda: load(small_vocabulary(g, tmp / "small.gguf", 1000))),
        ("4 wrong", "folder rope_scaling factor NaN", folder("nan", rope_scaling={"rope_type": "linear",
                                                                                   "factor": float("nan")})),
        ("4 wrong", "folder rope_scaling factor 0", folder("zero", rope_scaling={"rope_type": "linear", "factor": 0})),
        # 5. chat templates without bounds
        ("5 template", "nested range(99999) loops",
         template("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")),
        ("5 template", "'x' * 10**12 (compile)", template("{{ 'x' * 10**12 }}")),
        ("5 template", "'x' * 10**8", template("{{ 'x' * 10**8 }}")),
        # 6. output faults
        ("6 output", "explain --format json > /dev/full", lambda: run_cli(
            ["explain", "the cat sat", "--model", "random", "--format", "json"], stdout_path="/dev/full")),
        ("6 output", "generate > /dev/full", lambda: _generate_full(tmp, run_cli)),
        ("6 output", "explain --html onto a named pipe", lambda: _html_onto_fifo(tmp, run_cli)),
        # 7. greedy decoding of NaN logits
        ("7 greedy", "greedy decoding of NaN logits", lambda: _greedy(run_child)),
        # what held before: truncations, counts, offsets, dims, types, names, sandbox, safetensors
        *[("0 held", f"G cut at byte {at}", (lambda at=at: load(cut(g, tmp / f"cut{at}.gguf", at))))
          for at in (3, 10, 20, 100, 1000, 100_000, 2_000_000, size // 2, size - 1000, size - 1)],
        ("0 held", "G tensor count 2**40", lambda: load(patch(g, tmp / "tc.gguf", 8, "<Q", 2**40))),
        ("0 held", "G tensor count 2**63-1", lambda: load(patch(g, tmp / "tc2.gguf", 8, "<Q", 2**63 - 1))),
        ("0 held", "G metadata count 2**40", lambda: load(patch(g, tmp / "kc.gguf", 16, "<Q", 2**40))),
        ("0 held", "G metadata count 2**63-1", lambda: load(patch(g, tmp / "kc2.gguf", 16, "<Q", 2**63 - 1))),
        ("0 held", "G first key length 2**40", lambda: load(patch(g, tmp / "kl.gguf", 24, "<Q", 2**40))),
        ("0 held", "G first key length 2**63-1", lambda: load(patch(g, tmp / "kl2.gguf", 24, "<Q", 2**63 - 1))),
        ("0 held", "G tensor name length 2**40", lambda: load(patch(g, tmp / "tn.gguf", info["n_dims"] - len(
            info["name"]) - 8, "<Q", 2**40))),
        ("0 held", "G tensor offset past the end", lambda: load(patch(g, tmp / "to.gguf", info["offset"], "<Q",
                                                                      10**12))),
        ("0 held", "G tensor dims overflowing", lambda: load(patch(g, tmp / "td.gguf", info["dims"], "<Q",
                                                                   2**63 - 1))),
        ("0 held", "G tensor n_dims 2**31", lambda: load(patch(g, tmp / "tnd.gguf", info["n_dims"], "<I", 2**31))),
        ("0 held", "G unknown tensor type 999", lambda: load(patch(g, tmp / "tt.gguf", info["type"], "<I", 999))),
        ("0 held", "G unsupported tensor type Q8_1", lambda: load(patch(g, tmp / "tq.gguf", info["type"], "<I",
                                                                        int(gguf.GGMLQuantizationType.Q8_1)))),
        ("0 held", "G duplicate tensor names", lambda: _duplicate(g, tmp, load)),
        ("0 held", "G unsupported architecture", lambda: load(rewrite_gguf(g, tmp / "arch.gguf", arch="gpt2"))),
        ("0 held", "G array length 2**40", lambda: load(_array_length(g, tmp, patch, 2**40))),
        ("0 held", "G array length 2**63-1", lambda: load(_array_length(g, tmp, patch, 2**63 - 1))),
        ("0 held", "G block_count 0", meta("blocks0", llama__block_count=0)),
        ("0 held", "G head_count a string", meta("headstr", llama__attention__head_count="nine")),
        ("0 held", "G no vocabulary: loads without a tokenizer", lambda: _loads(run_child({
            "kind": "load",
            "path": str(rewrite_gguf(g, tmp / "notok.gguf", metadata={"tokenizer.ggml.tokens": DROP}))}))),
        *[("0 held", f"template {s[:40]}", template(s)) for s in (
            "{{ messages.__class__.__mro__[1].__subclasses__() }}", "{{ ''.__class__.__base__ }}",
            "{{ raise_exception.__globals__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
            "{{ messages.append(1) }}", "{{ cycler.__init__.__globals__.os }}")],
        *[("0 held", f"safetensors {label}", (lambda raw=raw, label=label: load(_safetensors(tmp, label, raw))))
          for label, raw in _bad_safetensors()],
        ("0 held", "folder n_layer 10**7 (GPT-2)", lambda: load(_gpt2(tmp, n_layer=10**7))),
        ("0 held", "folder config.json a directory", lambda: load(_config_dir(tmp, write_hf_decoder))),
    ]
    return rows


def _bigdim(tmp, write_hf_decoder, load):
    from hostile_files import append_tensor

    folder = write_hf_decoder(tmp / "bigdim")
    append_tensor(folder / "model.safetensors", "extra.weight", [0, 2**63])
    return load(folder, "model.safetensors")


def _duplicate(g, tmp, load):
    """Two tensors named alike: blk.0.attn_k.weight's name overwritten with blk.0.attn_q.weight."""
    from hostile_files import tensor_info_at

    b = tensor_info_at(g, "blk.0.attn_k.weight")
    data = bytearray(g.read_bytes())
    start = b["n_dims"] - len(b["name"])
    data[start:start + len(b["name"])] = b"blk.0.attn_q.weight"
    path = tmp / "dup.gguf"
    path.write_bytes(bytes(data))
    return load(path)


def _array_length(g, tmp, patch, value):
    from hostile_files import field_at

    at, _ = field_at(g, "tokenizer.ggml.tokens")
    key_len = len("tokenizer.ggml.tokens")
    return patch(g, tmp / f"al{value}.gguf", at + 8 + key_len + 4 + 4, "<Q", value)


def _bad_safetensors():
    import struct

    good = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return [
        ("header length past the file", struct.pack("<Q", 2**63) + b"{}"),
        ("header not JSON", struct.pack("<Q", 4) + b"{{{{" + bytes(8)),
        ("unknown dtype", _st({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, 8)),
        ("offsets outside the file", _st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8000]}}, 8)),
        ("overlapping tensors", _st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12)),
        ("shape and offsets disagree", _st({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8)),
        ("header nested 100000 deep", struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000),
        ("a good header", struct.pack("<Q", len(good)) + good + bytes(8)),  # not a model: named refusal
    ]


def _st(header: dict, nbytes: int) -> bytes:
    import struct

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(nbytes)


def _safetensors(tmp, label, raw):
    from hostile_files import write_hf_decoder

    folder = write_hf_decoder(tmp / ("st-" + label.replace(" ", "-")), tokenizer=False)
    (folder / "model.safetensors").write_bytes(raw)
    return folder


def _gpt2(tmp, **changes):
    import numpy as np

    from attnlab.io import save_tensors
    from attnlab.io.names import gpt2_name_map, gpt2_transposed
    from attnlab.models.gpt2 import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    state = GPT2(cfg, rng=np.random.default_rng(0)).state_dict()
    transposed = gpt2_transposed(2)
    folder = tmp / "gpt2"
    folder.mkdir(exist_ok=True)
    save_tensors(folder / "model.safetensors", {
        src: np.ascontiguousarray(state[k].T if k in transposed else state[k])
        for k, (src,) in gpt2_name_map(2).items()})
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", **cfg.to_dict(), **changes}))
    return folder


def _config_dir(tmp, write_hf_decoder):
    folder = write_hf_decoder(tmp / "cfgdir", tokenizer=False)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    return folder


def _generate_full(tmp, run_cli):
    folder = _gpt2(tmp)
    return run_cli(["generate", "--checkpoint", str(folder), "1 2 3", "--max-new-tokens", "2"],
                   stdout_path="/dev/full")


def _html_onto_fifo(tmp, run_cli):
    path = tmp / "report.html"
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    import stat

    def still_a_pipe():
        return stat.S_ISFIFO(os.stat(path).st_mode)

    out = run_cli(["explain", "the cat sat", "--model", "random", "--html", str(path)], check=still_a_pipe)
    out["outcome"] += "" if still_a_pipe() else " (the pipe was replaced by a regular file)"
    return out


def _loads(out: dict) -> dict:
    """Loads, with finite logits (a file that is not hostile)."""
    out["pass"] = out.get("outcome", "").startswith("loaded, logits finite")
    return out


def _greedy(run_child):
    out = run_child({"kind": "greedy_nan"})
    out["pass"] = out.get("outcome") == "raised" and "ValueError" in out.get("mro", [])
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="run the cases whose name holds this text")
    parser.add_argument("--keep", default=None, help="build the files in this folder (default: a temporary one)")
    args = parser.parse_args()
    from attnlab.models.llama import smollm2_path

    g = smollm2_path()
    print(f"attnlab hostile-input checks; G = {g.name}; CPU {_cpu_name()}, "
          f"load {os.getloadavg()[0]:.2f}; limits {LIMIT_S:g} s, {LIMIT_MB:g} MB above the import's baseline")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.keep or d)
        tmp.mkdir(parents=True, exist_ok=True)
        results = []
        for group, name, thunk in cases(g, tmp):
            if args.only and args.only not in name:
                continue
            out = thunk()
            results.append((group, name, out))
            mb = f"{out['above_mb']:7.0f}" if "above_mb" in out else "      -"
            s = f"{out['seconds']:6.2f}" if "seconds" in out else "     -"
            what = out["outcome"] if out.get("outcome") != "raised" else f"{out['type'].split('.')[-1]}: " \
                f"{out['message'].splitlines()[0] if out['message'] else ''}"
            print(f"{'ok  ' if out['pass'] else 'FAIL'} {group:10s} {name:48s} {s} s {mb} MB  {what[:150]}",
                  flush=True)
            for p in list(tmp.glob("*.gguf")):
                p.unlink()
    held = sum(r[2]["pass"] for r in results)
    print(f"\n{held} of {len(results)} checks hold")
    refusals = [r for r in results if r[2].get("outcome") == "raised" and "above_mb" in r[2]]
    for label, key, unit in (("memory", "above_mb", "MB above the baseline"), ("time", "seconds", "s")):
        worst = sorted(refusals, key=lambda r: -r[2][key])[:3]
        print(f"most {label} of a refusal: " + "; ".join(f"{r[1]} {r[2][key]:.2f} {unit}" for r in worst))


if __name__ == "__main__":
    main()
