"""BERT checkpoint folders, good and hostile: parity of a tiny random BERT with
transformers; every malformed or oversized file refused early with a clear error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from attnlab.io import load_tensors
from attnlab.models.bert import BertConfig, BertEncoder, CheckpointError
from helpers import TINY_BERT, tiny_bert_weights, tiny_tokenizer, write_tiny_bert

pytest.importorskip("tokenizers", reason="the tokenizers library (pretrained extra)")


def test_tiny_random_bert_matches_transformers(tmp_path):
    pytest.importorskip("transformers", reason="transformers (test extra)")
    import torch
    from transformers import BertConfig as HFConfig
    from transformers import BertModel

    folder = write_tiny_bert(tmp_path / "tiny", prefix="bert.")  # BertForMaskedLM-style names
    ours = BertEncoder.from_pretrained(folder)
    hf = BertModel(HFConfig(**TINY_BERT, attn_implementation="eager"), add_pooling_layer=False).eval()
    state = {k.removeprefix("bert."): torch.from_numpy(v)
             for k, v in load_tensors(folder / "model.safetensors").items()}
    hf.load_state_dict(state, strict=False)
    ids = np.array([[1, 5, 7, 9, 2, 0], [1, 3, 2, 0, 0, 0]])
    mask = (np.arange(6) < np.array([[5], [3]])).astype(np.int64)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 output_attentions=True, output_hidden_states=True)
    out = ours.forward(ids, mask)
    real = mask.astype(bool)
    for layer in range(3):
        err = np.abs(out.hidden_states[layer] - ref.hidden_states[layer].numpy())
        assert err[real].max() < 1e-5
        assert err.max() < 1e-4  # padded rows drift more in float32 (in torch too)
    for layer in range(2):
        assert np.abs(out.attentions[layer] - ref.attentions[layer].numpy()).max() < 1e-5


def test_not_a_folder_or_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        BertEncoder.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        BertEncoder.from_pretrained(tmp_path)
    folder = write_tiny_bert(tmp_path / "t")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        BertEncoder.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(CheckpointError, match="pickle file, never loaded"):
        BertEncoder.from_pretrained(folder)


def test_not_a_bert_config(tmp_path):
    folder = write_tiny_bert(tmp_path / "gpt", config=dict(TINY_BERT, model_type="gpt2"))
    with pytest.raises(CheckpointError, match=r"config.json: model_type is 'gpt2', but should be 'bert'"):
        BertEncoder.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        BertEncoder.from_pretrained(folder)
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    with pytest.raises(CheckpointError, match="missing field"):
        BertEncoder.from_pretrained(folder)
    (folder / "config.json").write_text('{"model_type": "bert", "vocab_size": 40, '
                                        '"hidden_size": 9, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 2, "intermediate_size": 4, '
                                        '"max_position_embeddings": 8}')
    with pytest.raises(CheckpointError, match="divisible"):
        BertEncoder.from_pretrained(folder)


def test_malformed_safetensors(tmp_path):
    folder = write_tiny_bert(tmp_path / "t")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* lies outside the file"):
        BertEncoder.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        BertEncoder.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        BertEncoder.from_pretrained(folder)


def test_tensor_of_wrong_shape_dtype_or_missing(tmp_path):
    good = tiny_bert_weights()
    name = "encoder.layer.1.intermediate.dense.weight"
    bad = dict(good, **{name: np.zeros((16, 9), np.float32)})
    folder = write_tiny_bert(tmp_path / "shape", tensors=bad)
    with pytest.raises(CheckpointError,
                       match=r"tensor 'encoder.layer.1.intermediate.dense.weight' has shape "
                             r"\(16, 9\), but should be \(16, 8\)"):
        BertEncoder.from_pretrained(folder)
    bad = dict(good, **{name: np.zeros((16, 8), np.int32)})
    folder = write_tiny_bert(tmp_path / "dtype", tensors=bad)
    with pytest.raises(CheckpointError, match=r"has dtype I32, but should be a float"):
        BertEncoder.from_pretrained(folder)
    bad = {k: v for k, v in good.items() if k != name}
    folder = write_tiny_bert(tmp_path / "missing", tensors=bad)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) encoder.layer.1.intermediate"):
        BertEncoder.from_pretrained(folder)
    folder = write_tiny_bert(tmp_path / "other", tensors={"lm_head.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match="not a BERT checkpoint"):
        BertEncoder.from_pretrained(folder)
    nan = dict(good, **{name: np.full((16, 8), np.nan, np.float32)})
    folder = write_tiny_bert(tmp_path / "nan", tensors=nan)
    with pytest.raises(CheckpointError, match="NaN or inf"):
        BertEncoder.from_pretrained(folder)


def test_malformed_tokenizer(tmp_path):
    folder = write_tiny_bert(tmp_path / "t")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a valid tokenizer file"):
        BertEncoder.from_pretrained(folder)


# ---- config values checked against the tensors present ---------------------------------


def _write_config(folder, **changes):
    (folder / "config.json").write_text(json.dumps(dict(TINY_BERT, model_type="bert", **changes)))


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 1000), ("vocab_size", 10**6),
                                          ("max_position_embeddings", 10**7), ("intermediate_size", 10**6),
                                          ("hidden_size", 120_000)])
def test_a_config_larger_than_the_checkpoint_is_refused_at_once(tmp_path, field, value):
    folder = write_tiny_bert(tmp_path / "t")
    _write_config(folder, **{field: value})
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=rf"config.json: {field} is {value}, but .*model.safetensors"):
            BertEncoder.from_pretrained(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, peak  # refused before anything large is built (memory, not a timing)


def test_weights_in_memory_are_checked_against_the_config_too():
    cfg = BertConfig(**dict(TINY_BERT, num_hidden_layers=10**7))
    weights = tiny_bert_weights()
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="num_hidden_layers is 10000000, but weights holds 2 layer"):
            BertEncoder(cfg, weights)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak  # refused before ten million layers are built


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0, 0.0, "1e-12", True])
def test_bad_layer_norm_eps(tmp_path, eps):
    folder = write_tiny_bert(tmp_path / "t")
    _write_config(folder, layer_norm_eps=eps)
    with pytest.raises(CheckpointError, match=r"config.json: layer_norm_eps must be a (positive finite )?float"):
        BertEncoder.from_pretrained(folder)


def test_tokenizer_ids_beyond_the_vocabulary(tmp_path):
    folder = write_tiny_bert(tmp_path / "t")
    tiny_tokenizer(extra=20).save(str(folder / "tokenizer.json"))  # ids up to 88, vocab_size 80
    with pytest.raises(CheckpointError, match=r"tokenizer.json: the tokenizer has ids up to 88 \(89 tokens\), "
                                              r"but the model has vocab_size=80"):
        BertEncoder.from_pretrained(folder)
    with pytest.raises(CheckpointError, match="tokenizer: the tokenizer has ids up to 88"):
        BertEncoder(BertConfig(**TINY_BERT), tokenizer=tiny_tokenizer(extra=20))


def test_malformed_header_shape_is_named(tmp_path):
    folder = write_tiny_bert(tmp_path / "t")
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["embeddings.LayerNorm.bias"]["shape"] = 8  # an int, not a list
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'embeddings.LayerNorm.bias' has shape 8"):
        BertEncoder.from_pretrained(folder)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_directory_or_device_instead_of_a_file(tmp_path, name):
    folder = write_tiny_bert(tmp_path / "t")
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises(CheckpointError, match=rf"{name} is a directory, not a"):
        BertEncoder.from_pretrained(folder)
    if os.path.exists("/dev/zero"):
        (folder / name).rmdir()
        (folder / name).symlink_to("/dev/zero")
        with pytest.raises(CheckpointError, match=rf"{name} is a character device, not a"):
            BertEncoder.from_pretrained(folder)


def test_a_hub_id_offline_is_one_clear_error():
    pytest.importorskip("huggingface_hub")
    code = ("from attnlab.models.bert import BertEncoder\n"
            "try:\n    BertEncoder.from_pretrained('attnlab-tests/no-such-model')\n"
            "except FileNotFoundError as exc:\n    print(exc)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)  # a guard against a hang on the network, not a speed check
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("attnlab-tests/no-such-model is not a folder, and the Hugging Face hub did not "
                                 "provide it (")
    assert len(res.stdout.strip().splitlines()) == 1
