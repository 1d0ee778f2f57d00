"""`attnlab train`, checkpoints, the recall task and the explain backend (short runs only:
the full training run that reaches >= 99% is measured, not tested)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.train import checkpoint as ckpt
from attnlab.train.loop import NonFiniteLossError, TrainConfig, Trainer
from attnlab.train.tasks import IGNORE_INDEX, RecallTask


# ---- the task -------------------------------------------------------------------------
def test_recall_task_layout_and_targets():
    task = RecallTask()
    assert task.num_keys >= 16 and task.num_pairs >= 8 and task.seq_len >= 32
    ids, targets = task.sample(50, rng=np.random.default_rng(0))
    assert ids.shape == targets.shape == (50, task.seq_len)
    P = task.num_pairs
    for row, tgt in zip(ids, targets, strict=True):
        keys, values = row[0 : 2 * P : 2], row[1 : 2 * P : 2]
        assert len(set(keys)) == P and keys.max() < task.num_keys and values.min() >= task.num_keys
        pairs = dict(zip(keys, values, strict=True))
        q_keys, q_values = row[2 * P :: 2], row[2 * P + 1 :: 2]
        assert all(pairs[k] == v for k, v in zip(q_keys, q_values, strict=True))
        answer = np.nonzero(tgt != IGNORE_INDEX)[0]
        assert np.array_equal(answer, np.arange(2 * P, task.seq_len, 2))
        assert np.array_equal(tgt[answer], row[answer + 1])


def test_recall_task_is_seeded_and_validates():
    a = RecallTask().sample(3, rng=np.random.default_rng(5))
    b = RecallTask().sample(3, rng=np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="num_pairs"):
        RecallTask(num_keys=4, num_pairs=5)
    with pytest.raises(ValueError, match="unknown tokens"):
        RecallTask().encode("k1 v2 banana")


def test_heldout_set_is_not_the_training_stream():
    t = Trainer.build(config=TrainConfig(steps=1, eval_size=8))
    train_ids, _ = t.task.sample(8, rng=np.random.default_rng(t.config.seed))
    assert not np.array_equal(train_ids, t.heldout[0])


# ---- checkpoints ------------------------------------------------------------------------
def _trainer(steps=3):
    return Trainer.build(config=TrainConfig(steps=steps, batch_size=8, eval_size=16))


def test_checkpoint_round_trip(tmp_path):
    t = _trainer()
    t.train_step()
    path = tmp_path / "c.npz"
    ckpt.save_checkpoint(path, t.model, t.task, meta={"step": 1})
    model, task, meta = ckpt.load_checkpoint(path)
    assert task == t.task and meta == {"step": 1}
    for name, value in t.model.state_dict().items():
        assert np.array_equal(model.state_dict()[name], value)
    ids = t.heldout[0][:2]
    assert np.array_equal(model.eval()(ids), t.model.eval()(ids))
    with np.load(path, allow_pickle=False) as data:  # readable without pickle
        assert "head.weight" in data.files


def test_explain_checkpoint(tmp_path):
    from attnlab.explain import Explanation, explain

    t = _trainer()
    path = tmp_path / "c.npz"
    ckpt.save_checkpoint(path, t.model, t.task)
    ex = explain("k1 v5 k2 v9 k1", model="checkpoint", path=path)
    assert isinstance(ex, Explanation)
    assert (ex.layer, ex.head, ex.model_name) == (2, 0, "checkpoint")
    for h in range(4):  # the trace is the layer's own computation
        np.testing.assert_array_equal(ex.trace.get("weights", h), ex.attentions[1, h])
    assert ex.trace.tokens == ex.tokens and ex.trace.layer == 2
    first = explain("k1 v5 k2 v9 k1", model="checkpoint", path=path, layer=1, head=3)
    np.testing.assert_array_equal(first.trace.get("weights", 3), first.attentions[0, 3])
    assert ex.tokens == ["k1", "v5", "k2", "v9", "k1"]
    assert ex.attentions.shape == (2, 4, 5, 5)
    assert np.allclose(ex.attentions.sum(-1), 1)
    assert ex.static.shape == ex.contextual.shape == (5, 64)
    assert any("induction: query 'k1' at position 4" in n for n in ex.notes)
    with pytest.raises(ValueError, match="unknown tokens"):
        explain("k1 hello", model="checkpoint", path=path)
    with pytest.raises(ValueError, match="needs path=FILE"):
        explain("k1", model="checkpoint")


# ---- the trainer ---------------------------------------------------------------------------
def test_non_finite_loss_stops_and_keeps_good_weights():
    t = Trainer.build(config=TrainConfig(steps=5, batch_size=4, eval_size=8, lr=1e30, clip=None, warmup=0))
    with pytest.raises(NonFiniteLossError):
        for _ in range(5):
            t.train_step()
    assert all(np.all(np.isfinite(v)) for v in t.good_state.values())


# ---- the CLI ---------------------------------------------------------------------------
def test_cli_train_smoke(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "20", "--out", str(out), "--eval-every", "10"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("steps", "seconds", "final_loss", "heldout_accuracy"):
        assert key in metrics
    assert metrics["steps"] == 20 and 0 <= metrics["heldout_accuracy"] <= 1
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, task, meta = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert meta["step"] == 20 and task == RecallTask()
    err = capsys.readouterr().err
    assert "step 20/20" in err and "loss" in err and "acc" in err
    assert not list(out.glob(".*tmp*"))  # no half-written files left


@pytest.mark.parametrize("steps", ["0", "-3", "ten", "1.5"])
def test_cli_bad_steps_exit_2_with_one_line(tmp_path, capsys, steps):
    assert main(["train", "--steps", steps, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps" in err
    assert not (tmp_path / "x").exists()


def test_cli_unwritable_out_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--steps", "2", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def test_cli_nan_loss_stops_with_a_message_and_keeps_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--steps", "50", "--lr", "1e30", "--out", str(out)])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "loss became" in err[-1] and "last good weights" in err[-1]
    model, _, meta = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert meta["status"] == "stopped: non-finite loss"
    assert all(np.all(np.isfinite(v)) for v in model.state_dict().values())


def _raise_at_call(monkeypatch, n: int, exc: BaseException) -> None:
    """Trainer.train_step raises ``exc`` on its ``n``-th call (as Ctrl-C or a kill would)."""
    real, calls = Trainer.train_step, {"n": 0}

    def train_step(self):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_cli_ctrl_c_saves_a_checkpoint(tmp_path, capsys, monkeypatch):
    _raise_at_call(monkeypatch, 4, KeyboardInterrupt())
    out = tmp_path / "run"
    assert main(["train", "--steps", "10", "--out", str(out)]) == 130
    assert "interrupted at step 3" in capsys.readouterr().err
    _, _, meta = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert meta["status"] == "interrupted" and meta["step"] == 2


def test_cli_explain_reads_a_trained_checkpoint(tmp_path, capsys):
    t = _trainer()
    path = tmp_path / "c.npz"
    ckpt.save_checkpoint(path, t.model, t.task)
    assert main(["explain", "--checkpoint", str(path), "k1 v5 k2 v9 k1"]) == 0
    out = capsys.readouterr().out
    assert "TinyTransformer" in out and "k1" in out
    assert main(["explain", "--checkpoint", str(path), "k1 bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown tokens" in err


def _disk_full_after(monkeypatch, good_saves: int):
    """np.savez writes part of the file, then fails as a full disk does, after ``good_saves``."""
    import errno

    real, calls = np.savez, {"n": 0}

    def savez(f, **arrays):
        calls["n"] += 1
        if calls["n"] > good_saves:
            f.write(b"PK\x03\x04 half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, **arrays)

    monkeypatch.setattr(np, "savez", savez)


def test_cli_full_disk_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    _disk_full_after(monkeypatch, 1)
    out = tmp_path / "run"
    code = main(["train", "--steps", "12", "--save-every", "5", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("step ") for line in err[:-1])  # progress lines, then one error
    assert err[-1].startswith("attnlab train: error: ")
    assert "cannot save the checkpoint of step 10: No space left on device" in err[-1]
    assert "kept the checkpoint of step 5" in err[-1]
    monkeypatch.undo()
    _, _, meta = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert meta["step"] == 5 and meta["status"] == "running"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.npz"]  # no temporary files


def test_cli_full_disk_before_any_checkpoint(tmp_path, capsys, monkeypatch):
    _disk_full_after(monkeypatch, 0)
    out = tmp_path / "run"
    assert main(["train", "--steps", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot save the checkpoint of step 3" in err[-1] and "no checkpoint was saved" in err[-1]
    assert list(out.iterdir()) == []


def test_cli_a_new_run_never_sits_beside_an_earlier_runs_files(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--out", str(out)]) == 0
    first = json.loads((out / "metrics.json").read_text())
    assert first["steps"] == 6
    _raise_at_call(monkeypatch, 3, SystemExit("killed"))  # no chance to save anything
    with pytest.raises(SystemExit):
        main(["train", "--steps", "9", "--seed", "1", "--out", str(out)])
    assert list(out.iterdir()) == []  # nothing of the first run is left to be mistaken for this one's


def test_cli_interrupted_run_writes_its_own_metrics_and_curves(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--out", str(out)]) == 0
    _raise_at_call(monkeypatch, 3, KeyboardInterrupt())
    assert main(["train", "--steps", "9", "--seed", "1", "--out", str(out)]) == 130
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["steps"] == 2
    assert metrics["train_config"]["seed"] == 1 and len(metrics["history"]["loss"]) == 2
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    _, _, meta = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert meta["seed"] == 1 and meta["status"] == "interrupted"


@pytest.mark.parametrize("flags", [["--d-model", "100000"], ["--layers", "1000000"],
                                   ["--batch-size", "100000000"],
                                   ["--num-keys", "5000000", "--num-pairs", "5000000",
                                    "--num-queries", "1"]])
def test_cli_sizes_that_cannot_fit_exit_2_before_allocating(tmp_path, capsys, flags):
    import tracemalloc

    tracemalloc.start()
    try:
        code = main(["train", *flags, "--out", str(tmp_path / "x")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be trained here" in err and "of memory is free" in err
    assert peak < 20 * 2**20  # refused before allocating (memory, not a timing)
    assert not (tmp_path / "x").exists()
