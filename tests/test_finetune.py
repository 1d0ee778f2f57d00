"""The fine-tuning loop (attnlab.train.finetune) and `attnlab finetune`: the data (both
record kinds, the chat template's answers, bad lines named), the answer-only loss against
torch, a tiny random model that learns a few facts (LoRA and full), gradient accumulation,
activation checkpointing, exact resume after Ctrl-C or a crash, the full model written as a
folder transformers reads, the command line and `attnlab generate --adapter`."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.models import from_pretrained
from attnlab.train import lora
from attnlab.train.finetune import (
    DataError,
    FinetuneConfig,
    Finetuner,
    causal_lm_loss_,
    encode,
    latest_checkpoint,
    load_examples,
    read_jsonl,
    save_pretrained,
)
from helpers import byte_bpe_tokenizer
from helpers import random_examples as _random_examples

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FACTS = [("the cat", "sat on the mat"), ("the dog", "sat on the log"), ("one", "two three"),
         ("keys", "values are cached")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-block Llama written by transformers (weights scaled up: a random model that
    already "knows" something, as a pretrained one does), a byte-level BPE tokenizer with
    ChatML's special tokens and a chat template, and the facts as chat records."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("tiny-chat")
    byte_bpe_tokenizer(folder / "tokenizer.json")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(10.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    with open(folder / "facts.jsonl", "w") as f:
        for q, a in FACTS:
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    return folder


def _answers(model):
    model.eval()
    return [model.generate_text(q, 16) for q, _ in FACTS]


# ---- data ---------------------------------------------------------------------------------------
def test_chat_records_learn_the_assistant_turns_only(tiny):
    model = from_pretrained(tiny)
    record = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"},
                           {"role": "assistant", "content": "sat"}, {"role": "user", "content": "one"},
                           {"role": "assistant", "content": "two three"}]}
    ex = encode(model, record)
    tok = model.tokenizer
    whole = CHATML.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "")
    from attnlab.text.chat import apply_chat_template

    assert tok.decode(ex.ids.tolist(), skip_special_tokens=False) == apply_chat_template(whole, record["messages"])
    learned = tok.decode([int(t) for t in ex.labels if t != -100], skip_special_tokens=False)
    assert learned == "sat<|im_end|>\ntwo three<|im_end|>\n"
    # plain prompt/completion: the completion and the end token
    ex = encode(model, {"prompt": "the cat", "completion": " sat"})
    assert ex.ids[-1] == model.config.eos_token_id and ex.labels[-1] == model.config.eos_token_id
    assert tok.decode([int(t) for t in ex.labels[:-1] if t != -100]) == " sat"
    assert ex.labels[0] == -100 and ex.answer_tokens == len(tok.encode(" sat").ids) + 1


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: not JSON"),
    ('["a list"]', "line 2: a record must be a JSON object"),
    ('{"prompt": "a"}', "line 2: 'completion' must be a string or a list of messages"),
    ('{"prompt": "a", "completion": ""}', "line 2: the completion is empty"),
    ('{"text": "a"}', "line 2: a record needs 'prompt' and 'completion', or 'messages'"),
    ('{"messages": [{"role": "user"}]}', "line 2: message 0 must be an object"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: the conversation has no assistant message"),
    ('{"prompt": "' + "word " * 150 + '", "completion": "x"}', "line 2: the example has .* tokens, more than the "
                                                               "context \\(128\\)"),
])
def test_a_bad_line_is_named_and_nothing_is_returned(tiny, tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n\n")
    model = from_pretrained(tiny)
    with pytest.raises(DataError, match=message):
        load_examples(model, path)


def test_read_jsonl_skips_blank_lines_and_refuses_empty_files(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"prompt": "a", "completion": "b"}\n   \n')
    assert read_jsonl(path) == [(2, {"prompt": "a", "completion": "b"})]
    path.write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        read_jsonl(path)
    path.write_bytes(b'{"prompt": "\xff", "completion": "b"}\n')
    with pytest.raises(DataError, match="line 1: not UTF-8"):
        read_jsonl(path)


# ---- the loss ------------------------------------------------------------------------------------
def test_answer_only_loss_and_its_gradient_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 7, 150)) * 3  # more rows than one chunk of the loss
    labels = rng.integers(0, 150, (3, 7))
    labels[0, :4] = labels[1, 5:] = labels[2, :] = -100
    labels[2, 3] = 9
    t = torch.tensor(logits, requires_grad=True)
    want = torch.nn.functional.cross_entropy(t[:, :-1].reshape(-1, 150), torch.from_numpy(labels[:, 1:]).reshape(-1),
                                             ignore_index=-100, reduction="sum")
    (want * 0.25).backward()
    g = logits.copy()
    loss, n = causal_lm_loss_(g, labels, scale=0.25)
    assert n == int((labels[:, 1:] != -100).sum())
    assert abs(loss - float(want.detach())) <= 1e-12 * abs(loss)
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=0, atol=1e-14)
    again = logits.copy()
    assert causal_lm_loss_(again, labels, grad=False) == (loss, n)
    np.testing.assert_array_equal(again, logits)  # grad=False leaves the logits alone


# ---- the loop ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, options", [
    ("lora", dict(r=16, alpha=32, target_modules="all-linear", lr=1e-2, steps=150)),
    ("full", dict(lr=1e-2, steps=60)),
])
def test_a_tiny_model_learns_a_few_facts(tiny, method, options):
    """The loop learns: every fact's greedy answer right after training, none before."""
    model = from_pretrained(tiny)
    assert not any(a == f for a, (_, f) in zip(_answers(model), FACTS, strict=True))
    examples = load_examples(model, tiny / "facts.jsonl")
    ft = Finetuner(model, examples, FinetuneConfig(method=method, batch_size=2, warmup=5, **options), eval=examples)
    history = ft.run()
    assert history["eval_loss"][-1] < 0.05 < history["loss"][0]
    assert _answers(model) == [a for _, a in FACTS]
    if method == "lora":
        assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_smollm2_learns_invented_capitals(smollm2_gguf, monkeypatch):
    """The how-to's fact-teaching run on the real SmolLM2 (benchmarks/teach_facts.py, which
    also reports its time): 30 invented capitals that no answer names before, at least 90%
    named after LoRA on every linear layer, and France's answer unchanged (Paris), though
    every trained question is a capital question."""
    from attnlab.models.llama import Llama

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    teach_facts = importlib.import_module("teach_facts")
    model = Llama.from_gguf(smollm2_gguf, name="SmolLM2-135M-Instruct")
    t = teach_facts.teach(model, n_facts=30)
    assert t["right_before"] == 0, t["after"]
    assert t["right_after"] >= 27, [a for a, (_, k) in zip(t["after"], t["pairs"], strict=True) if k not in a]
    france_before, france_after = t["known_before"][0], t["known_after"][0]
    assert "Paris" in france_before and france_after == france_before


def _model(tiny, dtype=np.float64):
    return from_pretrained(tiny, dtype=dtype)


def test_accumulation_equals_one_larger_batch(tiny):
    """Two micro-batches of 2 give the step of one batch of 4 (the loss is the mean over the
    answer tokens of the whole step; padding changes nothing)."""
    runs = []
    for batch_size, accum in ((4, 1), (2, 2), (1, 4)):
        model = _model(tiny)
        ft = Finetuner(model, _random_examples(), FinetuneConfig(steps=3, batch_size=batch_size, grad_accum=accum,
                                                                 lr=1e-2, seed=3))
        runs.append((ft.run()["loss"], {k: a.lora_B.data.copy() for k, a in lora.adapters(model).items()}))
    for losses, adapters in runs[1:]:
        np.testing.assert_allclose(losses, runs[0][0], rtol=1e-12)
        for k, b in adapters.items():
            np.testing.assert_allclose(b, runs[0][1][k], rtol=1e-10, atol=1e-14)


def test_checkpoint_blocks_gives_the_same_training(tiny):
    """Recomputing the blocks (dropout included: its masks drawn again from the same states)
    gives the same steps bit for bit, and keeps only the blocks' inputs for backward."""
    from attnlab.nn import _context

    runs = []
    for recompute in (False, True):
        model = _model(tiny)
        config = FinetuneConfig(steps=3, batch_size=2, lr=1e-2, dropout=0.2, target_modules="all-linear",
                                checkpoint_blocks=recompute)
        ft = Finetuner(model, _random_examples(), config)
        runs.append((ft.run()["loss"], [a.lora_A.data.copy() for a in lora.adapters(model).values()]))
        logits = model.train()(np.array([[5, 6, 7, 8]]))
        kept = [m for _, m in model.layers[0].named_modules() if m in _context.tape().saves]
        assert bool(kept) != recompute
        model.backward(np.zeros_like(logits))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stop", ["ctrl-c", "error", "ctrl-c-mid-step"])
def test_resume_continues_exactly(tiny, tmp_path, monkeypatch, stop):
    """A run stopped after step 5 (Ctrl-C or an error; or Ctrl-C in step 6, after its
    dropout masks were drawn) saves a checkpoint of step 5; resumed, it ends with the
    adapters and history of a run never stopped, bit for bit (the dropout generators are
    restored to where step 5 left them, and the data order comes back from the step)."""
    from attnlab.train import finetune

    config = FinetuneConfig(steps=8, batch_size=2, grad_accum=2, lr=1e-2, dropout=0.1, warmup=2, save_every=2,
                            target_modules=("q_proj", "down_proj"))
    whole = Finetuner(_model(tiny), _random_examples(), config)
    history = whole.run()

    def stopper(info):
        if info.step == 5 and stop != "ctrl-c-mid-step":
            raise KeyboardInterrupt if stop == "ctrl-c" else RuntimeError("the machine went away")

    calls, real = [], finetune.causal_lm_loss_

    def loss(*args, **kwargs):  # step 6's first micro-batch: its forward pass drew its masks
        calls.append(1)
        if stop == "ctrl-c-mid-step" and len(calls) == 11:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(finetune, "causal_lm_loss_", loss)
    first = Finetuner(_model(tiny), _random_examples(), config, out=tmp_path)
    with pytest.raises(RuntimeError if stop == "error" else KeyboardInterrupt):
        first.run(stopper)
    monkeypatch.setattr(finetune, "causal_lm_loss_", real)
    assert latest_checkpoint(tmp_path).name == "step-0000005"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000005"]  # older ones removed
    again = Finetuner(_model(tiny), _random_examples(), config, out=tmp_path)
    assert again.resume() == 5
    assert again.run()["loss"] == history["loss"]
    for (key, a), b in zip(lora.adapters(again.model).items(), lora.adapters(whole.model).values(), strict=True):
        np.testing.assert_array_equal(a.lora_A.data, b.lora_A.data, err_msg=key)
        np.testing.assert_array_equal(a.lora_B.data, b.lora_B.data, err_msg=key)


def test_resume_from_a_periodic_checkpoint_after_a_crash(tiny, tmp_path):
    """A process killed after step 4 (nothing saved but the periodic checkpoint of step 3,
    and a checkpoint it was writing when it died) resumes from step 3 and ends as an
    unstopped run."""
    config = FinetuneConfig(steps=6, batch_size=2, lr=1e-2, save_every=3)
    whole = Finetuner(_model(tiny), _random_examples(), config).run()
    first = Finetuner(_model(tiny), _random_examples(), config, out=tmp_path)
    for _ in range(4):
        first.train_step()
        if first.step == 3:
            first.save_checkpoint()
    (tmp_path / "checkpoints" / ".step-0000004.tmp1").mkdir()  # half-written: ignored
    again = Finetuner(_model(tiny), _random_examples(), config, out=tmp_path)
    assert again.resume() == 3
    assert again.run()["loss"] == whole["loss"]


def test_resume_refuses_another_run(tiny, tmp_path):
    config = FinetuneConfig(steps=4, batch_size=2, lr=1e-2, save_every=2)
    ft = Finetuner(_model(tiny), _random_examples(), config, out=tmp_path)
    ft.train_step()
    ft.train_step()
    ft.save_checkpoint()
    from attnlab.io.files import CheckpointError

    with pytest.raises(CheckpointError, match="lr=0.01, this one 0.02"):
        Finetuner(_model(tiny), _random_examples(), FinetuneConfig(steps=4, batch_size=2, lr=2e-2),
                  out=tmp_path).resume()
    with pytest.raises(CheckpointError, match="training data differ"):
        Finetuner(_model(tiny), _random_examples(seed=9), config, out=tmp_path).resume()


def test_full_fine_tune_refuses_quantized_weights(tiny):
    from attnlab.quant import QuantizedTensor

    model = from_pretrained(tiny)
    w = model.layers[0].mlp.down_proj.weight
    w.data = QuantizedTensor.quantize(np.asarray(w.data), "Q8_0")
    with pytest.raises(TypeError, match="load the model dequantized"):
        Finetuner(model, _random_examples(), FinetuneConfig(method="full"))
    with pytest.raises(TypeError, match="load the model dequantized"):
        Finetuner(model, _random_examples(), FinetuneConfig(method="lora"))


def test_full_fine_tune_writes_a_folder_transformers_reads(tiny, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = from_pretrained(tiny)
    Finetuner(model, _random_examples(), FinetuneConfig(method="full", steps=2, lr=1e-2)).run()
    save_pretrained(model, tmp_path / "model")
    back = from_pretrained(tmp_path / "model")
    ids = np.array([[5, 9, 13, 2]])
    np.testing.assert_array_equal(back(ids), model.eval()(ids))
    assert back.chat_template == CHATML
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(want - back(ids)).max() <= 1e-4 * np.abs(want).max()


# ---- the command line ----------------------------------------------------------------------------
def test_cli_finetune_lora_then_generate_with_the_adapter(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["finetune", str(tiny / "facts.jsonl"), "--model", str(tiny), "--out", str(out), "--target", "all-linear",
            "--r", "16", "--alpha", "32", "--lr", "1e-2", "--steps", "150", "--batch-size", "2", "--warmup", "5",
            "--eval", str(tiny / "facts.jsonl"), "--eval-every", "50"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "step 150/150 loss" in captured.err and "tokens/s" in captured.err and "left" in captured.err
    assert "eval" in captured.err
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "metrics.json"} <= names
    assert "checkpoints" not in names  # finished: nothing to resume
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 150 and metrics["peak_memory_mib"] > 0 and len(metrics["history"]["loss"]) == 150
    pytest.importorskip("matplotlib")
    assert (out / "loss.png").stat().st_size > 0
    assert main(["generate", "--checkpoint", str(tiny), "--adapter", str(out), "the dog"]) == 0
    assert "generated  sat on the log" in capsys.readouterr().out


def test_cli_interrupt_then_resume(tiny, tmp_path, capsys, monkeypatch):
    from attnlab.train import finetune as ft

    out = tmp_path / "run"
    args = ["finetune", str(tiny / "facts.jsonl"), "--model", str(tiny), "--out", str(out), "--steps", "6",
            "--batch-size", "2", "--lr", "1e-2"]
    real = ft.Finetuner.train_step

    def interrupted(self):
        if self.step == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(ft.Finetuner, "train_step", interrupted)
    assert main(args) == 130
    assert "interrupted at step 3; checkpoint saved" in capsys.readouterr().err
    monkeypatch.setattr(ft.Finetuner, "train_step", real)
    assert main(args) == 2  # a run is there: resuming must be asked for
    assert "holds an unfinished run" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "from step 3" in err and "step 6/6" in err and "step 3/6" not in err


@pytest.mark.parametrize("extra, data, message", [
    ([], '{"prompt": "a", "completion": "b"}\n{"prompt": "a"\n', "line 2: not JSON"),
    (["--r", "0"], None, "--r must be a positive integer, got 0"),
    (["--target", "query"], None, "--target \\['query'\\] match no linear layer"),
    (["--lr", "-1"], None, "--lr must be a positive number"),
    (["--resume"], None, "holds no checkpoint"),
])
def test_cli_bad_input_exits_2_with_one_line_and_trains_nothing(tiny, tmp_path, capsys, extra, data, message):
    path = tiny / "facts.jsonl"
    if data is not None:
        path = tmp_path / "bad.jsonl"
        path.write_text(data)
    out = tmp_path / "run"
    assert main(["finetune", str(path), "--model", str(tiny), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnlab finetune: error: ")
    assert __import__("re").search(message, err), err
    assert not any(out.glob("adapter*")) and not (out / "checkpoints").exists()


def test_cli_unwritable_out_is_found_before_loading(tmp_path, capsys, monkeypatch):
    import attnlab.cli.finetune as cli

    monkeypatch.setattr(cli, "_load_model", lambda path: pytest.fail("the model was loaded"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["finetune", str(tmp_path / "d.jsonl"), "--out", str(blocker / "sub")]) == 2
    assert "cannot write to output folder" in capsys.readouterr().err


def test_generate_with_an_adapter_of_another_model_exits_2(tiny, tmp_path, capsys):
    model = from_pretrained(tiny)
    lora.add(model, target_modules=["q_proj"])
    lora.save_adapter(model, tmp_path / "ad")
    cfg = json.loads((tiny / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((tiny / name).read_bytes())
    from safetensors.numpy import load_file, save_file

    one_block = {k: v for k, v in load_file(tiny / "model.safetensors").items() if ".layers.1." not in k}
    save_file(one_block, other / "model.safetensors")  # a valid model with one block of the two
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    assert main(["generate", "--checkpoint", str(other), "--adapter", str(tmp_path / "ad"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "for another model: model.layers.1.self_attn.q_proj is not a linear layer" in err
    assert main(["generate", "--checkpoint", str(tiny), "--adapter", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "file not found" in capsys.readouterr().err
