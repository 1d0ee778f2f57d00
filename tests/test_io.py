"""attnlab.io: the one safetensors reader (its header checked before anything is
allocated), name maps, and files that are not what they claim to be."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from attnlab.io import (
    CheckpointError,
    bert_name_map,
    load_mapped,
    load_tensors,
    read_header,
    read_json,
    regular_file,
    save_tensors,
)


def raw_file(path: Path, header: dict, data: bytes = b"") -> Path:
    """A safetensors file with exactly this header and these data bytes."""
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def test_round_trip_keeps_dtypes_shapes_and_values(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(5),
        "c": np.arange(6, dtype=np.int64).reshape(2, 3),
        "d": np.array([True, False]),
        "e": rng.standard_normal((2, 2)).astype(np.float16),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(2.5, np.float32),
    }
    path = save_tensors(tmp_path / "t.safetensors", tensors, {"format": "np"})
    infos, meta = read_header(path)
    assert meta == {"format": "np"}
    assert infos["a"].dtype == "F32" and infos["a"].shape == (3, 4)
    back = load_tensors(path)
    for name, arr in tensors.items():
        assert back[name].dtype == arr.dtype and np.array_equal(back[name], arr), name
    assert set(load_tensors(path, ["b"], dtype=np.float32)) == {"b"}


def test_the_safetensors_library_reads_our_files_and_we_read_its(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    save_tensors(tmp_path / "ours.safetensors", {"x": x})
    assert np.array_equal(st.load_file(str(tmp_path / "ours.safetensors"))["x"], x)
    st.save_file({"y": x.astype(np.float64)}, str(tmp_path / "theirs.safetensors"))
    assert np.array_equal(load_tensors(tmp_path / "theirs.safetensors")["y"], x.astype(np.float64))


def test_bfloat16_is_widened_to_float32(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    t = torch.tensor([[1.5, -2.25], [3.0e10, 1e-3]], dtype=torch.bfloat16)
    save_file({"w": t}, str(tmp_path / "bf.safetensors"))
    w = load_tensors(tmp_path / "bf.safetensors")["w"]
    assert w.dtype == np.float32 and np.array_equal(w, t.float().numpy())


OK = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "entry, message",
    [
        (dict(OK, shape=4), r"has shape 4, but a shape should be a list of non-negative ints"),
        (dict(OK, shape=[2, -2]), r"should be a list of non-negative ints"),
        (dict(OK, shape=[2, 2.0]), r"should be a list of non-negative ints"),
        (dict(OK, shape=[True, 4]), r"should be a list of non-negative ints"),
        (dict(OK, shape=[4, 4]), r"needs 64 bytes, but its data_offsets span 16"),
        (dict(OK, dtype="F8"), r"unknown dtype 'F8'"),
        (dict(OK, data_offsets=[0, 32]), r"lies outside the file"),
        (dict(OK, data_offsets=[8, 4]), r"lies outside the file"),
        (dict(OK, data_offsets=[0]), r"should be two ints"),
        ({"dtype": "F32", "shape": [2, 2]}, r"should have exactly dtype, shape and data_offsets"),
        ("F32", r"should have exactly dtype, shape and data_offsets"),
    ],
)
def test_malformed_header_entries_are_named(tmp_path, entry, message):
    path = raw_file(tmp_path / "bad.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(CheckpointError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value) and "'w'" in str(info.value)


def test_overlapping_tensors_and_unreadable_headers(tmp_path):
    path = raw_file(tmp_path / "o.safetensors", {"a": OK, "b": dict(OK, data_offsets=[8, 24])}, bytes(24))
    with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
        read_header(path)
    for data, message in [
        (b"", "only 0 bytes"),
        (b"\x01\x02", "only 2 bytes"),
        (struct.pack("<Q", 1000) + b"{}", "its header claims 1000 bytes, the file has 10"),
        (struct.pack("<Q", 2) + b"[]", "the header is not a JSON object"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "unreadable header"),
        (struct.pack("<Q", 2 ** 63) + bytes(8), "its header claims"),
    ]:
        p = tmp_path / "x.safetensors"
        p.write_bytes(data)
        with pytest.raises(CheckpointError, match=message):
            read_header(p)


def test_a_huge_header_is_refused_unread(tmp_path, monkeypatch):
    import attnlab.io.safetensors as st

    monkeypatch.setattr(st, "MAX_HEADER_BYTES", 100)
    path = raw_file(tmp_path / "big.safetensors", {f"t{i}": dict(OK, data_offsets=[0, 0], shape=[0])
                                                  for i in range(20)})
    with pytest.raises(CheckpointError, match="more than the 100 attnlab reads"):
        read_header(path)


def test_nan_and_inf_weights_are_refused(tmp_path):
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((2, 2), np.float32)
        w[1, 0] = bad
        path = save_tensors(tmp_path / "n.safetensors", {"ok": np.ones(2, np.float32), "w": w})
        with pytest.raises(CheckpointError, match=r"n.safetensors: tensor 'w' holds NaN or inf"):
            load_tensors(path)
        assert load_tensors(path, ["ok"])["ok"].sum() == 2


def test_directories_devices_and_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"is a directory, not a safetensors file"):
        read_header(tmp_path)
    if os.path.exists("/dev/zero"):
        with pytest.raises(CheckpointError, match=r"/dev/zero is a character device, not a safetensors file"):
            read_header("/dev/zero")
        with pytest.raises(CheckpointError, match=r"/dev/zero is a character device, not a JSON file"):
            read_json("/dev/zero")
    with pytest.raises(FileNotFoundError, match="nope.safetensors is missing"):
        read_header(tmp_path / "nope.safetensors")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="is a named pipe, not a file"):
        regular_file(fifo)


def test_read_json_refuses_big_broken_and_non_object_files(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="should hold a JSON object, got list"):
        read_json(p)
    p.write_text("{" * 100_000)
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        read_json(p)
    p.write_text('{"a": "' + "x" * 200 + '"}')
    with pytest.raises(CheckpointError, match="a JSON file should be under 100"):
        read_json(p, max_bytes=100)


def test_load_mapped_concatenates_and_checks_before_reading(tmp_path):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(3))
    path = save_tensors(tmp_path / "m.safetensors", {"m.q": q, "m.k": k, "m.v": v, "extra": q})
    name_map = {"qkv": ("q", "k", "v")}
    state = load_mapped(path, name_map, {"qkv": (12, 4)}, prefixes=("", "m."))
    assert np.array_equal(state["qkv"], np.concatenate([q, k, v]))
    with pytest.raises(CheckpointError, match=r"tensor 'q' has shape \(4, 4\), but should be \(5, 4\)"):
        load_mapped(path, name_map, {"qkv": (15, 4)}, prefixes=("", "m."))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) q, k, v \(this is not a toy checkpoint\)"):
        load_mapped(path, name_map, {"qkv": (12, 4)}, what="toy")


def test_bert_name_map_covers_every_layer():
    m = bert_name_map(2)
    assert len(m) == 5 + 2 * 12
    assert m["blocks.1.mlp.0.weight"] == ("encoder.layer.1.intermediate.dense.weight",)
    assert m["blocks.1.attn.in_proj_bias"][2] == "encoder.layer.1.attention.self.value.bias"
