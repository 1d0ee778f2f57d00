"""What explain shows from inside a decoder (attnlab.explain.inside): the logit lens, the head
detector scores and activation patching, against attnlab.inspect called directly; their JSON;
the CLI's summary and errors; the report's data."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.explain import Explanation, decode_array, explain
from attnlab.explain.inside import PATCH_METRIC, Lens, Patching, decoder_inside, patch_metric, top_heads
from attnlab.inspect import HEAD_KINDS, activation_patching, detect_heads, logit_lens, logit_lens_top
from attnlab.models import GPT2, GPT2Config, TinyTransformer, TinyTransformerConfig
from helpers import byte_bpe_tokenizer, random_gpt2

TEXT = "The cat sat on the mat. The cat sat"
CORRUPT = "The cat sat on the log. The cat sat"  # as many tokens, two of them different


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("gpt2-inside")
    byte_bpe_tokenizer(folder / "tokenizer.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_gpt2(folder, seed=7, n_layer=3, n_head=4, n_embd=32, vocab_size=300)
    return folder


@pytest.fixture(scope="module")
def recall_file(tmp_path_factory):
    from attnlab.train.checkpoint import save_checkpoint
    from attnlab.train.tasks import RecallTask

    task = RecallTask()
    cfg = TinyTransformerConfig(vocab_size=len(task.vocab), context_length=task.seq_len, d_model=16,
                                n_heads=2, n_layers=2, d_ff=32)
    path = tmp_path_factory.mktemp("recall-inside") / "c.npz"
    model = TinyTransformer(cfg, rng=np.random.default_rng(3))
    rng = np.random.default_rng(4)
    for p in model.parameters():  # off the initial zeros and ones
        p.data += (rng.standard_normal(p.shape) * 0.3).astype(p.dtype)
    save_checkpoint(path, model, task)
    return path


def _metric(a: int, b: int):
    return lambda logits: float(np.asarray(logits)[0, -1, a]) - float(np.asarray(logits)[0, -1, b])


# ---- the numbers are attnlab.inspect's -------------------------------------------------------


def test_gpt2_fields_equal_attnlab_inspect(gpt2_folder):
    e = explain(TEXT, model="gpt2", path=gpt2_folder, corrupt=CORRUPT)
    model = GPT2.from_pretrained(gpt2_folder)
    ids, tokens = model.encode(TEXT)
    bad, _ = model.encode(CORRUPT)
    T, N = len(ids), 3
    assert e.tokens == tokens and len(bad) == T and (bad != ids).sum() == 2

    logits, cache = model.run_with_cache(ids[None])
    top, probs = logit_lens_top(model, cache, k=3)
    assert e.lens.ids.shape == (N + 1, T, 3)
    np.testing.assert_array_equal(e.lens.ids, top[:, 0])
    np.testing.assert_array_equal(e.lens.probs, probs[:, 0])
    # the full lens: the top token is its argmax, the last layer the model's own logits
    full = logit_lens(model, cache)[:, 0].astype(np.float64)  # (N + 1, T, V)
    np.testing.assert_array_equal(e.lens.ids[..., 0], full.argmax(-1))
    np.testing.assert_array_equal(e.lens.ids[-1, :, 0], logits[0].argmax(-1))
    soft = np.exp(full - full.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    np.testing.assert_allclose(e.lens.probs, np.take_along_axis(soft, e.lens.ids, -1), rtol=1e-6, atol=1e-9)
    vocab = model.tokenizer
    assert e.lens.tokens()[2][5] == vocab.id_to_token(int(e.lens.ids[2, 5, 0]))

    assert sorted(e.head_scores) == sorted(HEAD_KINDS)
    for kind in HEAD_KINDS:
        np.testing.assert_array_equal(e.head_scores[kind], detect_heads(model, ids[None], kind))
        assert e.head_scores[kind].shape == (N, 4)

    p = e.patching
    corrupted_logits = model(bad[None])
    a, b = int(logits[0, -1].argmax()), int(np.argsort(-corrupted_logits[0, -1])[0])
    if b == a:
        b = int(np.argsort(-corrupted_logits[0, -1])[1])
    assert (p.clean_id, p.corrupted_id) == (a, b) and a != b
    assert p.clean_token == vocab.id_to_token(a) and p.corrupted_token == vocab.id_to_token(b)
    want = activation_patching(model, ids[None], bad[None], _metric(a, b), hook="resid_pre")
    np.testing.assert_array_equal(p.values, want)
    assert p.clean_value == _metric(a, b)(logits) and p.corrupted_value == _metric(a, b)(corrupted_logits)
    assert p.hook == "resid_pre" and p.metric == PATCH_METRIC and p.corrupted_tokens == model.encode(CORRUPT)[1]
    # Patching block 0 at a position where the texts agree changes nothing (the same embedding).
    same = np.flatnonzero(bad == ids)
    np.testing.assert_allclose(p.values[0, same], p.corrupted_value, atol=1e-5)
    np.testing.assert_allclose(p.restored()[0, same], 0.0, atol=1e-5)


def test_checkpoint_fields_equal_attnlab_inspect(recall_file):
    from attnlab.train.checkpoint import load_checkpoint

    text, corrupt = "k1 v5 k2 v9 k1", "k1 v5 k2 v3 k1"
    e = explain(text, model="checkpoint", path=recall_file, corrupt=corrupt)
    model, task, _ = load_checkpoint(recall_file)
    model.eval()
    ids, bad = task.encode(text), task.encode(corrupt)
    _, cache = model.run_with_cache(ids[None])
    top, probs = logit_lens_top(model, cache, k=3)
    np.testing.assert_array_equal(e.lens.ids, top[:, 0])
    np.testing.assert_array_equal(e.lens.probs, probs[:, 0])
    assert e.lens.tokens()[0] == [task.vocab[int(i)] for i in top[0, 0, :, 0]]
    for kind in HEAD_KINDS:
        np.testing.assert_array_equal(e.head_scores[kind], detect_heads(model, ids[None], kind))
    a, b = e.patching.clean_id, e.patching.corrupted_id
    np.testing.assert_array_equal(e.patching.values,
                                  activation_patching(model, ids[None], bad[None], _metric(a, b)))
    assert e.patching.values.shape == (2, 5) and e.patching.corrupted_tokens == corrupt.split()


def test_no_corrupted_text_no_patching_and_encoders_have_nothing(gpt2_folder):
    e = explain(TEXT, model="gpt2", path=gpt2_folder)
    assert e.lens is not None and e.head_scores is not None and e.patching is None
    r = explain("the cat sat", dim=8, heads=2)
    assert (r.lens, r.head_scores, r.patching) == (None, None, None)


def test_lens_in_chunks_of_positions_is_the_same_lens():
    model = GPT2(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(0))
    ids = np.random.default_rng(1).integers(0, 40, 23)
    vocab = [f"t{i}" for i in range(40)]
    whole, scores, _ = decoder_inside(model, ids, vocab, chunk=128)
    parts, _, _ = decoder_inside(model, ids, vocab, chunk=5, heads=False)
    np.testing.assert_array_equal(parts.ids, whole.ids)
    np.testing.assert_allclose(parts.probs, whole.probs, rtol=1e-6)
    assert whole.ids.shape == (3, 23, 3) and set(whole.strings) == set(np.unique(whole.ids).tolist())
    assert whole.strings[int(whole.ids[0, 0, 0])] == f"t{whole.ids[0, 0, 0]}"


def test_patch_metric_and_top_heads():
    clean = np.array([[[0.0, 1.0, 5.0, 2.0]]])
    assert patch_metric(clean, np.array([[[0.0, 9.0, 1.0, 3.0]]])) == (2, 1)
    assert patch_metric(clean, np.array([[[0.0, 1.0, 9.0, 3.0]]])) == (2, 3)  # same prediction: the runner-up
    assert top_heads(np.array([[0.2, np.nan], [0.7, 0.2]]), 3) == [(1, 0, 0.7), (0, 0, 0.2), (1, 1, 0.2)]


def test_a_corrupted_text_of_another_length_is_refused_before_patching():
    model = GPT2(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=2, n_head=2),
                 rng=np.random.default_rng(0))
    encode = lambda s: (np.array([int(w) for w in s.split()]), s.split())  # noqa: E731
    with pytest.raises(ValueError, match=r"^the corrupted text has 2 tokens but the text has 3: "):
        decoder_inside(model, np.array([1, 2, 3]), [str(i) for i in range(40)], corrupt="1 2", encode=encode)
    with pytest.raises(ValueError, match=r"^the corrupted text has 1 token but the text has 3: "):
        decoder_inside(model, np.array([1, 2, 3]), [str(i) for i in range(40)], corrupt="7", encode=encode)


# ---- JSON ----------------------------------------------------------------------------------------


def test_json_round_trip(gpt2_folder):
    e = explain(TEXT, model="gpt2", path=gpt2_folder, corrupt=CORRUPT)
    d = json.loads(json.dumps(e.to_dict(), ensure_ascii=False, allow_nan=False))
    assert d["version"] == 5
    lens = d["lens"]
    ids = decode_array(lens["ids"])
    assert ids.dtype == np.int64 and lens["shape"] == [4, len(e.tokens), 3]
    np.testing.assert_array_equal(ids, e.lens.ids)
    np.testing.assert_allclose(decode_array(lens["probs"]), e.lens.probs, atol=0.5e-4, rtol=0)
    strings = dict(zip(lens["token_ids"], lens["token_strings"], strict=True))
    assert strings == {i: e.lens.strings[i] for i in np.unique(e.lens.ids).tolist()}
    for kind in HEAD_KINDS:
        np.testing.assert_allclose(decode_array(d["head_scores"][kind]), e.head_scores[kind], rtol=5e-4, atol=0)
    p = d["patching"]
    np.testing.assert_allclose(decode_array(p["values"]), e.patching.values, rtol=5e-4, atol=0)
    assert p["clean_prediction"] == {"id": e.patching.clean_id, "token": e.patching.clean_token}
    assert p["corrupted_prediction"]["id"] == e.patching.corrupted_id
    assert (p["corrupted_text"], p["corrupted_tokens"]) == (CORRUPT, e.patching.corrupted_tokens)
    assert p["hook"] == "resid_pre"
    assert p["clean_value"] == pytest.approx(e.patching.clean_value, rel=5e-4)
    assert p["metric"] == PATCH_METRIC
    none = json.loads(json.dumps(explain("a b", dim=4, heads=1).to_dict()))
    assert (none["lens"], none["head_scores"], none["patching"]) == (None, None, None)


def test_json_lens_is_sized_to_its_content():
    """A 1024-token lens of a 12-block model with GPT-2's vocabulary: its part of the document
    stays small (ids as uint16/uint32 codes, probabilities in 1e-4 units, each string once)."""
    rng = np.random.default_rng(0)
    T, N, V = 1024, 12, 50257
    lens = Lens(rng.integers(0, V, (N + 1, T, 3)), rng.dirichlet(np.ones(4), (N + 1, T))[..., :3],
                {i: f"tok{i}" for i in range(V)})
    e = Explanation("x", ["x"] * T, "toy", np.zeros((N, 1, T, T)), np.zeros((T, 2)), np.zeros((T, 2)), lens=lens)
    part = json.dumps(e._lens_dict(), separators=(",", ":"))
    assert len(part.encode()) < 1_500_000
    np.testing.assert_array_equal(decode_array(json.loads(part)["ids"]), lens.ids)


def test_encode_ids_takes_uint32_when_needed():
    from attnlab.explain import encode_ids

    assert encode_ids(np.array([0, 65535]))["dtype"] == "uint16"
    big = encode_ids(np.array([[0, 65536, 151_000]]))
    assert big["dtype"] == "uint32" and decode_array(big).tolist() == [[0, 65536, 151_000]]
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 2\*\*32\), got values in \[-1, 2\]"):
        encode_ids(np.array([-1, 2]))


# ---- the CLI -------------------------------------------------------------------------------------


def test_cli_prints_the_lens_the_best_heads_and_the_patching(gpt2_folder, capsys):
    assert main(["explain", "--checkpoint", str(gpt2_folder), TEXT, "--corrupt", CORRUPT]) == 0
    out = capsys.readouterr().out
    e = explain(TEXT, model="gpt2", path=gpt2_folder, corrupt=CORRUPT)
    assert "numbering: layers count from 0 (the embeddings): layer k is the output of block k - 1" in out
    shown = e.readable_tokens()  # byte-level tokens as text: 'Ġsat' reads '␣sat'
    assert e.token_scheme == "byte-level" and shown[-1] == e.tokens[-1].replace("Ġ", "\u2423") != e.tokens[-1]
    assert f"logit lens at the last position (token {len(e.tokens) - 1}, {shown[-1]!r})" in out
    assert "Ġ" not in out
    for k in range(4):
        top = e.readable_tokens([e.lens.strings[int(e.lens.ids[k, -1, 0])]])[0]
        assert re.search(rf"^  layer +{k}  {re.escape(repr(top))} p={e.lens.probs[k, -1, 0]:.2f}", out, re.M)
    assert "(the embeddings)" in out and "(the model's prediction)" in out
    for kind in HEAD_KINDS:
        i, h, v = top_heads(e.head_scores[kind], 1)[0]
        assert re.search(rf"^  {kind} +block {i} head {h} \(layer {i + 1}\) {v:.2f}, ", out, re.M)
    p = e.patching
    clean, wrong = e.readable_tokens([p.clean_token, p.corrupted_token])
    assert (f"metric: logit({clean!r}) - logit({wrong!r}) at the last position" in out
            and f"clean run {p.clean_value:.3f}, corrupted run {p.corrupted_value:.3f}" in out)
    rows = [line for line in out.splitlines() if line.startswith("block ")]
    assert len(rows) == 3 and rows[0].split()[2:] == [f"{v:.2f}" for v in p.values[0]]
    assert "␣m/␣l" in out  # a position where the texts differ: text/corrupted


def test_cli_json_has_the_new_fields(gpt2_folder, capsys):
    assert main(["explain", "--checkpoint", str(gpt2_folder), TEXT, "--corrupt", CORRUPT, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["version"] == 5 and d["lens"]["shape"][0] == 4
    assert set(d["head_scores"]) == set(HEAD_KINDS) and d["patching"]["values"]["shape"] == [3, 14]


def test_cli_corrupted_text_of_another_length_is_one_line_naming_both(gpt2_folder, recall_file, capsys):
    longer = "The dog sat on the mat. The cat sat"
    assert main(["explain", "--checkpoint", str(gpt2_folder), TEXT, "--corrupt", longer]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.fullmatch(r"attnlab explain: error: --corrupt: the corrupted text has 15 tokens but the text has 14: "
                        r"activation patching compares the two position by position, so both need the same number "
                        r"of tokens\n", err), err
    assert main(["explain", "--checkpoint", str(recall_file), "k1 v5 k2 v9 k1", "--corrupt", "k1 v5 k2 v9"]) == 2
    err = capsys.readouterr().err
    assert "the corrupted text has 4 tokens but the text has 5" in err and err.count("\n") == 1
    assert main(["explain", "--checkpoint", str(recall_file), "k1 v5", "--corrupt", "k1 zz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab explain: error: --corrupt: the corrupted text: ") and err.count("\n") == 1


def test_cli_corrupt_needs_a_decoder(capsys):
    assert main(["explain", "the cat sat", "--model", "random", "--corrupt", "the dog sat"]) == 2
    err = capsys.readouterr().err
    assert err == ("attnlab explain: error: --corrupt needs a decoder (--model checkpoint or gpt2 or smollm2): "
                   "model random predicts no next token to patch\n")
    assert main(["explain", "the cat sat", "--model", "random", "--corrupt", "  "]) == 2


def test_cli_summary_without_the_new_fields_is_unchanged(capsys):
    assert main(["explain", "the cat sat", "--model", "random"]) == 0
    out = capsys.readouterr().out
    assert "logit lens" not in out and "head detectors" not in out and "numbering:" not in out


# ---- the report's data ----------------------------------------------------------------------------


def _payload(html: str) -> dict:
    m = re.search(r'<script type="application/json" class="al-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_report_carries_the_new_views(gpt2_folder):
    from attnlab.viz import render_html

    e = explain(TEXT, model="gpt2", path=gpt2_folder, corrupt=CORRUPT)
    data = _payload(render_html(e))
    assert data["lens"]["k"] == 3 and len(data["lens"]["strings"]) == len(np.unique(e.lens.ids))
    assert data["arrays"]["lens_index"]["dtype"] == "u16" and data["arrays"]["lens_index"]["shape"] == [4, 14, 3]
    assert data["arrays"]["patch"]["shape"] == [3, 14]
    np.testing.assert_allclose(data["detectors"]["induction"], e.head_scores["induction"], atol=0.5e-4)
    assert data["patching"]["corrupted_tokens"] == e.readable_tokens(e.patching.corrupted_tokens)
    assert data["tokens"] == e.readable_tokens() and "Ġ" not in json.dumps(data["tokens"])
    assert "Ġsat" in e.to_dict()["tokens"]  # the JSON keeps the raw tokens
    plain = _payload(render_html(explain("a b", dim=4, heads=1)))
    assert (plain["lens"], plain["detectors"], plain["patching"]) == (None, None, None)


def test_report_refuses_new_fields_of_the_wrong_shape(gpt2_folder):
    from attnlab.viz import render_html

    e = explain(TEXT, model="gpt2", path=gpt2_folder, corrupt=CORRUPT)
    good = e.lens
    e.lens = Lens(good.ids[:, :-1], good.probs[:, :-1], good.strings)
    with pytest.raises(ValueError, match=r"explanation.lens has ids \(4, 13, 3\) and probs \(4, 13, 3\), but both "
                                         r"should be \(4, 14, k\)"):
        render_html(e)
    e.lens = good
    e.head_scores = {"induction": np.zeros((2, 4))}
    with pytest.raises(ValueError, match=r"head_scores\['induction'\] has shape \(2, 4\), but should be \(3, 4\)"):
        render_html(e)
    e.head_scores = None
    p = e.patching
    e.patching = Patching(np.zeros((3, 5)), "x", ["x"] * 5, 0, "a", 1, "b", 1.0, 0.0)
    with pytest.raises(ValueError, match=r"patching.values has shape \(3, 5\), but should be \(3, 14\)"):
        render_html(e)
    e.patching = p
    e.patching.values = np.full((3, 14), np.nan)
    with pytest.raises(ValueError, match=r"patching.values contains NaN or infinity"):
        render_html(e)


# ---- encoders: the attention rollout ---------------------------------------------------------------


def _minilm():
    try:
        from attnlab.models.bert import minilm_available, shared_minilm
    except ImportError:
        return None
    return shared_minilm() if minilm_available() else None


def test_minilm_rollout_is_attnlab_inspect_on_its_hook_patterns():
    from attnlab.inspect import attention_rollout

    model = _minilm()
    if model is None:
        pytest.skip("the pretrained MiniLM package is not installed")
    text = "The bank of the river was quiet"
    e = explain(text, model="minilm")
    _, ids, types = model._one_text(text)
    patterns = {}
    with model.hooks([(lambda n: n.endswith("hook_pattern"), lambda a, n: patterns.__setitem__(n, a.copy()))]):
        model._run(ids, types)
    want = attention_rollout(model, patterns)[:, 0]
    assert e.rollout.shape == (6, len(e.tokens), len(e.tokens))
    np.testing.assert_allclose(e.rollout, want, rtol=1e-6, atol=1e-9)
    assert (e.lens, e.head_scores, e.patching) == (None, None, None)
    d = json.loads(json.dumps(e.to_dict()))
    np.testing.assert_allclose(decode_array(d["rollout"]), e.rollout, atol=0.5e-4, rtol=0)


def test_decoders_have_no_rollout(gpt2_folder):
    e = explain(TEXT, model="gpt2", path=gpt2_folder)
    assert e.rollout is None and e.to_dict()["rollout"] is None
