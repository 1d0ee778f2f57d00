"""Any sentence-transformers BERT folder: random-weight BERTs written by transformers
(``save_pretrained``, safetensors), wrapped in sentence-transformers pipelines of every
pooling mode, with and without Normalize, in both layouts; attnlab's ``encode`` equals
sentence-transformers' within 1e-5."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from helpers import tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch", reason="torch (the test oracle)")
transformers = pytest.importorskip("transformers", reason="transformers (the test oracle)")
st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the test oracle)")

from attnlab.models.bert import BertEncoder  # noqa: E402

SHAPES = {  # hidden, heads, layers, intermediate, positions
    "8x2x2": (8, 2, 2, 16, 32),
    "12x3x1": (12, 3, 1, 20, 24),
    "16x4x3": (16, 4, 3, 40, 40),
}
TEXTS = [
    "the cat sat on the mat.",
    "the bank of the river",
    "money, money, money!",
    "a",
    "",
    "the quick brown fox jumps over the lazy dog and the river bank is full of money.",  # truncated
    "The Bank Of The River",  # upper case: [UNK] unless lower-cased
    "zebras xylophone quiz",
]


def write_transformer(folder, shape: str, *, seed: int, lowercase: bool = True):
    """A random BertModel and its fast tokenizer, written by transformers."""
    hidden, heads, layers, inter, positions = SHAPES[shape]
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=80, hidden_size=hidden, num_attention_heads=heads,
                                  num_hidden_layers=layers, intermediate_size=inter,
                                  max_position_embeddings=positions)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    with torch.no_grad():  # LayerNorms and biases off their ones and zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    tok = transformers.BertTokenizerFast(tokenizer_object=tiny_tokenizer(lowercase=lowercase),
                                         unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                         pad_token="[PAD]", mask_token="[MASK]", do_lower_case=lowercase)
    tok.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    return folder


def st6_folder(tmp_path, shape, pooling, normalize, *, max_len, seed=0):
    """Saved by sentence-transformers 6: pooling_mode, 2_Normalize, model_max_length."""
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf = write_transformer(tmp_path / "hf", shape, seed=seed)
    tr = Transformer(str(hf), max_seq_length=max_len)
    modules = [tr, Pooling(tr.get_embedding_dimension(), pooling)] + ([Normalize()] if normalize else [])
    folder = tmp_path / "st"
    st.SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    assert "max_seq_length" not in json.loads((folder / "sentence_bert_config.json").read_text())
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == max_len
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == pooling
    return folder


def classic_folder(tmp_path, shape, pooling, normalize, *, max_len, lower_case=False, seed=0):
    """The classic layout, as older sentence-transformers wrote it: the transformer in
    0_Transformer/ with sentence_bert_config.json, pooling_mode_*_token(s) flags."""
    folder = tmp_path / "classic"
    model_dir = write_transformer(folder / "0_Transformer", shape, seed=seed, lowercase=not lower_case)
    (model_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_len, "do_lower_case": lower_case}))
    (folder / "1_Pooling").mkdir()
    flags = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": pooling == "max", "pooling_mode_mean_sqrt_len_tokens": False}
    hidden = SHAPES[shape][0]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": hidden, **flags}))
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        (folder / "2_Normalize").mkdir()
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def compare(folder, texts=TEXTS):
    ref_model = st.SentenceTransformer(str(folder), device="cpu")
    ref = ref_model.encode(texts, batch_size=3, show_progress_bar=False)
    ours = BertEncoder.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the long text is truncated, with a warning
        got = ours.encode(texts, batch_size=3)
    assert got.shape == ref.shape and got.dtype == np.float32
    assert ours.max_seq_length == ref_model.max_seq_length
    err = float(np.abs(got - ref).max())
    assert err < 1e-5, err
    return ours, got


# every pooling mode with and without Normalize; the shapes take turns
CASES = [(shape, pooling, normalize) for i, (pooling, normalize) in
         enumerate((p, n) for p in ("mean", "cls", "max") for n in (True, False))
         for shape in [list(SHAPES)[i % 3]]] + [("16x4x3", "cls", True), ("8x2x2", "max", False)]


@pytest.mark.parametrize("shape, pooling, normalize", CASES)
def test_sentence_transformers_6_folders(tmp_path, shape, pooling, normalize):
    ours, got = compare(st6_folder(tmp_path, shape, pooling, normalize, max_len=12, seed=len(shape)))
    assert ours.pooling == pooling and ours.normalize is normalize and ours.max_seq_length == 12
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5) == normalize


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
@pytest.mark.parametrize("normalize", [True, False])
def test_classic_folders(tmp_path, pooling, normalize):
    ours, _ = compare(classic_folder(tmp_path, "12x3x1", pooling, normalize, max_len=10, seed=3))
    assert ours.pooling == pooling and ours.normalize is normalize and ours.max_seq_length == 10


def test_classic_lower_casing(tmp_path):
    folder = classic_folder(tmp_path, "8x2x2", "mean", True, max_len=16, lower_case=True, seed=4)
    ours, got = compare(folder)
    # "The Bank Of The River" reads as the lower-case text, not as [UNK]s
    assert np.abs(got[6] - ours.encode("the bank of the river")).max() < 1e-6


def test_a_plain_transformer_folder_pools_by_the_mean_without_normalising(tmp_path):
    folder = write_transformer(tmp_path / "plain", "8x2x2", seed=5)
    ours, got = compare(folder)
    assert ours.pooling == "mean" and ours.normalize is False
    assert not np.allclose(np.linalg.norm(got, axis=1), 1)


def test_unsupported_modules_and_pooling_are_refused(tmp_path):
    from attnlab.io import CheckpointError

    folder = classic_folder(tmp_path, "8x2x2", "mean", False, max_len=8)
    cfg = folder / "1_Pooling" / "config.json"
    cfg.write_text(json.dumps({"pooling_mode_mean_sqrt_len_tokens": True}))
    with pytest.raises(CheckpointError, match=r"1_Pooling/config.json: pooling 'mean_sqrt_len_tokens' is not "
                                              r"supported"):
        BertEncoder.from_pretrained(folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=r"modules.json: module 'sentence_transformers.models.Dense' is not "
                                              r"supported"):
        BertEncoder.from_pretrained(folder)
