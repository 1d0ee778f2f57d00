"""Hostile and broken checkpoint files: each gets one ValueError naming the file (one line,
exit code 2, in the CLI), before anything large is allocated, with its file handles closed."""

from __future__ import annotations

import io
import json
import os
import stat
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.train import checkpoint as ckpt
from attnlab.train.loop import TrainConfig, Trainer


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A real checkpoint of the default model (2 blocks, d_model 64)."""
    t = Trainer.build(config=TrainConfig(steps=1, batch_size=4, eval_size=8))
    path = tmp_path_factory.mktemp("good") / "c.npz"
    ckpt.save_checkpoint(path, t.model, t.task, meta={"step": 0})
    return path


def _arrays(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _write(path: Path, arrays: dict, *, compressed: bool = False) -> Path:
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, **arrays)
    return path


def _header(arrays) -> dict:
    return json.loads(str(arrays[ckpt.META_KEY]))


def _with_header(arrays, change) -> dict:
    header = _header(arrays)
    change(header)
    return {**arrays, ckpt.META_KEY: np.array(json.dumps(header))}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _refused(path, match: str) -> str:
    """load_checkpoint raises one ValueError naming the file, matching ``match``."""
    before = _open_fds()
    with pytest.raises(ValueError, match=match) as info:
        ckpt.load_checkpoint(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg
    assert "allow_pickle" not in msg
    assert _open_fds() == before  # nothing left open
    return msg


# ---- files that are not checkpoints ---------------------------------------------------------
def test_empty_file(tmp_path):
    (tmp_path / "e.npz").write_bytes(b"")
    _refused(tmp_path / "e.npz", "is empty")


@pytest.mark.parametrize("content", [b"not a zip", b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', ...",
                                     b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00]\x94.",
                                     b"PK"], ids=["text", "npy", "pickle", "two-bytes"])
def test_not_a_zip_is_never_told_about_pickle(tmp_path, content):
    (tmp_path / "x.npz").write_bytes(content)
    _refused(tmp_path / "x.npz", r"not an \.npz checkpoint \(it is not a zip archive\)")


def test_directory_and_device_and_pipe_are_named(tmp_path):
    _refused(tmp_path, "is a directory, not a checkpoint file")
    _refused(Path("/dev/null"), "is a character device")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.npz")
        _refused(tmp_path / "fifo.npz", "is a named pipe")  # never opened: it would block


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "missing.npz")


@pytest.mark.parametrize("keep", [0.5, 0.99, 100 / 107_000])
def test_truncated(good, tmp_path, keep):
    data = good.read_bytes()
    path = tmp_path / "t.npz"
    path.write_bytes(data[: max(4, int(len(data) * keep))])
    _refused(path, "truncated or corrupt")


def test_flipped_bytes_in_data_and_header_are_caught(good, tmp_path):
    data = good.read_bytes()
    arrays = _arrays(good)
    for needle in (arrays["head.weight"].tobytes()[:32], '"format"'.encode("utf-32-le"), b"PK\x01\x02"):
        at = data.index(needle) + 3
        bad = bytearray(data)
        bad[at] ^= 0x5A
        path = tmp_path / "f.npz"
        path.write_bytes(bytes(bad))
        _refused(path, "corrupt|bad header|not an attnlab")


def test_flipping_any_byte_gives_the_same_model_or_a_value_error(good, tmp_path):
    data = good.read_bytes()
    model, _, _ = ckpt.load_checkpoint(good)
    want = model.state_dict()
    path = tmp_path / "f.npz"
    caught = 0
    positions = range(0, len(data), 211)
    for at in positions:
        bad = bytearray(data)
        bad[at] ^= 0xFF
        path.write_bytes(bytes(bad))
        try:
            got, _, _ = ckpt.load_checkpoint(path)
        except ValueError as exc:
            assert str(path) in str(exc)
            caught += 1
            continue
        # an undetected flip can only be in bytes that carry no weight (e.g. a timestamp)
        assert all(np.array_equal(got.state_dict()[k], v) for k, v in want.items())
    assert caught >= 0.9 * len(positions)


# ---- untrusted sizes: refused before anything is allocated ---------------------------------
def _cheap(path, match: str) -> int:
    """Refused before anything large is built: checked by the memory allocated (a timing
    would depend on the machine and its load)."""
    tracemalloc.start()
    try:
        _refused(path, match)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB allocated before refusing"
    return peak


def test_zip_bomb(good, tmp_path):
    arrays = _arrays(good)
    arrays["blocks.0.mlp.0.weight"] = np.zeros((64, 1 << 20), np.float32)  # 256 MiB of zeros
    path = _write(tmp_path / "bomb.npz", arrays, compressed=True)
    assert path.stat().st_size < 2 * 2**20
    _cheap(path, "zip bomb")


def test_overlapping_entries_bomb(good, tmp_path):
    """Many directory entries pointing at the same compressed data (a 'quine'-style bomb)."""
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.npy", b"\0" * (1 << 20))
    data = raw.getvalue()
    cd = data.index(b"PK\x01\x02")
    eocd = data.index(b"PK\x05\x06")
    entry = data[cd:eocd]
    n = 2000
    entries = b"".join(entry.replace(b"a.npy", f"{i:05d}"[:5].encode()) for i in range(n))
    end = bytearray(data[eocd:])
    end[8:10] = end[10:12] = n.to_bytes(2, "little")
    end[12:16] = len(entries).to_bytes(4, "little")
    end[16:20] = cd.to_bytes(4, "little")
    path = tmp_path / "overlap.npz"
    path.write_bytes(data[:cd] + entries + bytes(end))
    _cheap(path, "corrupt|zip bomb")


@pytest.mark.parametrize("field,value", [("n_layers", 10**7), ("vocab_size", 10**8),
                                         ("d_model", 10**6), ("d_ff", 10**9)])
def test_config_asking_for_far_more_than_the_file_holds(good, tmp_path, field, value):
    arrays = _with_header(_arrays(good), lambda h: h["model"].__setitem__(field, value))
    if field == "vocab_size":  # keep the task consistent so that only the size is wrong
        arrays = _with_header(arrays, lambda h: h["task"].update(num_keys=value - 16))
    path = _write(tmp_path / "huge.npz", arrays)
    _cheap(path, "needs [0-9,]+ weights, but the file holds")


def test_task_far_bigger_than_the_model(good, tmp_path):
    arrays = _with_header(_arrays(good), lambda h: h["task"].update(num_keys=10**9))
    _cheap(_write(tmp_path / "task.npz", arrays), "the task needs")


def test_huge_header(good, tmp_path):
    arrays = _with_header(_arrays(good), lambda h: h["meta"].__setitem__("pad", "x" * (1 << 21)))
    _cheap(_write(tmp_path / "h.npz", arrays), "more than a checkpoint's header ever needs")


def test_npy_header_that_lies_about_its_size(good, tmp_path):
    arrays = _arrays(good)
    path = _write(tmp_path / "lie.npz", arrays)
    data = path.read_bytes()
    old = b"'shape': (32, 64)"
    assert old in data
    path.write_bytes(data.replace(old, b"'shape': (99, 64)", 1))
    _refused(path, "its header says")


# ---- contents ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_name_the_tensor(good, tmp_path, value):
    arrays = _arrays(good)
    arrays["blocks.1.attn.in_proj_weight"] = arrays["blocks.1.attn.in_proj_weight"].copy()
    arrays["blocks.1.attn.in_proj_weight"][3, 5] = value
    msg = _refused(_write(tmp_path / "nan.npz", arrays), "NaN or infinite")
    assert "'blocks.1.attn.in_proj_weight'" in msg and "1 of the 12,288 values" in msg


def test_pickled_object_array_is_never_loaded(good, tmp_path):
    arrays = _arrays(good)
    path = tmp_path / "obj.npz"
    with open(path, "wb") as f:
        np.savez(f, **arrays, evil=np.array([{"a": 1}], dtype=object))
    _refused(path, r"Python objects \(pickle\), which attnlab never loads")


def test_integer_tensor_and_unknown_entries(good, tmp_path):
    arrays = _arrays(good)
    arrays["head.weight"] = np.zeros((32, 64), np.int64)
    _refused(_write(tmp_path / "int.npz", arrays), "'head.weight' of dtype int64")
    raw = good.read_bytes()
    path = tmp_path / "extra.npz"
    path.write_bytes(raw)
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("notes.txt", "hello")
    _refused(path, "unexpected entry 'notes.txt'")


@pytest.mark.parametrize("change,match", [
    (lambda h: h.__setitem__("format", "other"), "unknown format"),
    (lambda h: h["model"].__setitem__("n_heads", 5), "divisible"),
    (lambda h: h["model"].__setitem__("wings", 2), "unknown TinyTransformerConfig fields"),
    (lambda h: h.pop("task"), "bad header"),
])
def test_bad_header_values(good, tmp_path, change, match):
    _refused(_write(tmp_path / "h.npz", _with_header(_arrays(good), change)), match)


def test_header_that_is_not_json(good, tmp_path):
    arrays = {**_arrays(good), ckpt.META_KEY: np.array("{not json")}
    _refused(_write(tmp_path / "h.npz", arrays), "not JSON")


def test_missing_or_misshaped_tensor_is_named(good, tmp_path):
    arrays = _arrays(good)
    del arrays["blocks.1.ln_2.weight"]
    _refused(_write(tmp_path / "m.npz", arrays), r"no tensor 'blocks\.1\.ln_2\.weight'.*\(64,\)")
    arrays = {**_arrays(good), "head.weight": np.zeros((3, 64), np.float32)}
    _refused(_write(tmp_path / "s.npz", arrays), r"'head\.weight' has shape \(3, 64\).*needs \(32, 64\)")
    arrays = {**_arrays(good), "extra.weight": np.zeros(3, np.float32)}
    _refused(_write(tmp_path / "x.npz", arrays), "unexpected keys")


def test_a_good_checkpoint_still_loads_from_compressed_files(good, tmp_path):
    path = _write(tmp_path / "z.npz", _arrays(good), compressed=True)
    model, task, meta = ckpt.load_checkpoint(path)
    ref, _, _ = ckpt.load_checkpoint(good)
    assert meta == {"step": 0}
    assert all(np.array_equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_explain_gives_one_line_for_every_bad_file(good, tmp_path, capsys):
    bad = {
        "empty.npz": b"",
        "text.npz": b"hello",
        "truncated.npz": good.read_bytes()[:5000],
    }
    paths = [tmp_path / "dir", Path("/dev/null")]
    (tmp_path / "dir").mkdir()
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        paths.append(tmp_path / name)
    arrays = _arrays(good)
    arrays["head.weight"] = np.full((32, 64), np.nan, np.float32)
    paths.append(_write(tmp_path / "nan.npz", arrays))
    for path in paths:
        assert main(["explain", "--checkpoint", str(path), "k1 v2 k1"]) == 2, path
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1 and str(path) in captured.err, captured.err
        assert "Traceback" not in captured.err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
