"""The Llama family (Llama, Mistral, Qwen2, Qwen3) against transformers: random-weight
models of several shapes written with save_pretrained (MQA and GQA ratios 2, 3 and 4,
every rope_scaling type, a sliding window shorter than the prompt, tied and untied
embeddings, Qwen2's biases, Qwen3's QK-norm): logits, hidden states and attention maps
layer by layer, greedy generation (one prompt and a left-padded batch), the cache."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.models.llama import Llama, LlamaConfig  # noqa: E402

V = 97
BASE = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=40,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# id -> (transformers config class, options)
CASES = {
    "llama-mha-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-gqa2-bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                            mlp_bias=True)),
    "llama-gqa3-llama3": ("LlamaConfig", dict(num_attention_heads=6, num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "llama-mqa-linear": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-gqa4-dynamic": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16,
                                               rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                "factor": 3.0})),
    "llama-yarn": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 10})),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5)),
    "qwen2-bias-tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-window-layer": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True,
                                               sliding_window=4, max_window_layers=1)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(transformers model in eval mode, attnlab model from its saved folder, case id)."""
    cls_name, options = CASES[request.param]
    torch.manual_seed(sorted(CASES).index(request.param))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls_name)(**{**BASE, **options}, attn_implementation="eager")
        model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
        hf = model_cls(config).eval()
        with torch.no_grad():  # larger weights than the 0.02 init: the logits' differences are visible
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.2)
                else:
                    p.mul_(8.0)
        folder = tmp_path_factory.mktemp(request.param)
        hf.save_pretrained(folder)
    return hf, Llama.from_pretrained(folder), request.param


def prompt(rng, B, T):
    return rng.integers(3, V, (B, T))


def test_logits_hidden_states_and_maps_match_transformers(pair):
    hf, ours, case = pair
    rng = np.random.default_rng(1)
    T = 24 if "dynamic" not in case else 30  # dynamic: past max_position_embeddings=16
    ids = prompt(rng, 2, T)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), output_hidden_states=True, output_attentions=True)
    got = ours.inspect(ids)
    want = out.logits.numpy()
    assert np.abs(got.logits - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), case
    assert np.abs(want).max() > 1.0  # the logits are not all near zero
    n = ours.config.num_hidden_layers
    hs = [h.numpy() for h in out.hidden_states]
    for k in range(n):  # embeddings and blocks before the last; the last is after the final norm
        assert np.abs(got.hidden_states[k] - hs[k]).max() <= 1e-4 * max(1.0, np.abs(hs[k]).max()), (case, k)
    assert np.abs(ours.ln_f(got.hidden_states[n]) - hs[n]).max() <= 1e-4 * max(1.0, np.abs(hs[n]).max())
    for k, a in enumerate(out.attentions):
        assert np.abs(got.attentions[k] - a.numpy()).max() <= 1e-4, (case, k)
    if "window" in case:  # the window is shorter than the prompt: some causal keys are masked
        w = ours.config.window(n - 1)
        assert w is not None and w < T
        assert (got.attentions[n - 1][:, :, -1, : T - w] == 0).all()


def test_cached_logits_equal_full_recompute(pair):
    hf, ours, case = pair
    rng = np.random.default_rng(2)
    # dynamic scaling changes the frequencies once a call reaches past max_position_embeddings
    # (16 here), so keys cached before were rotated otherwise (as in transformers): within it
    T = 14 if "dynamic" in case else 20
    ids = prompt(rng, 2, T)
    full = ours(ids)
    cache = ours.new_cache()
    parts = [ours(ids[:, :9], cache=cache)]
    for t in range(9, T):
        parts.append(ours(ids[:, t : t + 1], cache=cache))
    stepped = np.concatenate(parts, axis=1)
    assert np.abs(stepped - full).max() <= 1e-5 * max(1.0, np.abs(full).max()), case


def test_greedy_generation_equals_transformers(pair):
    hf, ours, case = pair
    rng = np.random.default_rng(3)
    new = 10
    single = prompt(rng, 1, 7)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(single), max_new_tokens=new, do_sample=False, pad_token_id=0,
                           eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours.generate(single, new), want)
    # a left-padded batch of prompts of lengths 12, 7 and 10
    lengths = [12, 7, 10]
    ids = np.zeros((3, 12), np.int64)
    mask = np.zeros((3, 12), np.int64)
    for i, n in enumerate(lengths):
        ids[i, 12 - n :] = prompt(rng, 1, n)[0]
        mask[i, 12 - n :] = 1
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                           do_sample=False, pad_token_id=0, eos_token_id=None).numpy()
    np.testing.assert_array_equal(ours.generate(ids, new, attention_mask=mask), want)


def test_the_arrangement_and_hooks(pair):
    hf, ours, case = pair
    c = ours.config
    attn = ours.layers[0].attn
    assert attn.num_kv_heads == hf.config.num_key_value_heads and attn.num_heads == hf.config.num_attention_heads
    assert (attn.q_norm is not None) == case.startswith("qwen3")
    assert (attn.in_proj_bias is not None) == (case.startswith("qwen2") or "bias" in case and case.startswith("llama"))
    assert ("lm_head.weight" in ours.state_dict()) == (not c.tie_word_embeddings)
    names = ours.hook_names()
    for name in ("hook_embed", "blocks.0.ln1.hook_normalized", "blocks.0.attn.hook_rot_q", "blocks.1.mlp.hook_pre",
                 "blocks.1.mlp.hook_pre_linear", "blocks.1.mlp.hook_post", "ln_final.hook_normalized"):
        assert name in names, name
    ids = prompt(np.random.default_rng(4), 1, 6)
    _, cache = ours.run_with_cache(ids, names_filter=["blocks.0.attn.hook_k", "blocks.0.attn.hook_rot_k"])
    assert cache["blocks.0.attn.hook_k"].shape == (1, 6, c.kv_heads, c.head_size)
    # position 0 is not rotated: its rotated key is the (normed) key, times yarn's attention factor
    k0 = cache["blocks.0.attn.hook_k"][0, 0]
    if attn.k_norm is not None:
        k0 = attn.k_norm(k0)
    k0 = k0 * np.float32(attn.rotary.attention_factor)
    np.testing.assert_allclose(cache["blocks.0.attn.hook_rot_k"][0, 0], k0, rtol=1e-5, atol=1e-6)


# ---- configs and errors -------------------------------------------------------------
def test_unsupported_family_and_rope_type_are_named(tmp_path):
    base = {**BASE, "num_attention_heads": 4}
    with pytest.raises(CheckpointError, match=r"model_type 'gemma' .* not supported; supported: llama "
                                              r"\(LlamaForCausalLM\), mistral"):
        LlamaConfig.from_dict({**base, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(CheckpointError, match=r"architectures \['LlamaModel'\] is not supported"):
        LlamaConfig.from_dict({**base, "model_type": "llama", "architectures": ["LlamaModel"]})
    with pytest.raises(CheckpointError, match=r"rope_scaling type 'longrope' is not supported; supported types: "
                                              r"default, linear, dynamic, llama3, yarn"):
        LlamaConfig.from_dict({**base, "model_type": "llama",
                               "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, where="x/config.json")


def test_missing_and_misshapen_tensors_are_refused(tmp_path):
    from attnlab.io import save_tensors

    cfg = {**BASE, "num_attention_heads": 4, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "num_hidden_layers": 1, "tie_word_embeddings": True}
    model = Llama(LlamaConfig.from_dict(cfg), rng=np.random.default_rng(0))
    import json

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = {"model.embed_tokens.weight": np.zeros((V, 48), np.float32)}
    save_tensors(tmp_path / "model.safetensors", weights)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.0"):
        Llama.from_pretrained(tmp_path)
    assert model.config.head_size == 12


def test_prompt_longer_than_the_context_and_bad_ids():
    cfg = LlamaConfig(vocab_size=20, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=8)
    model = Llama(cfg, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="context_length=8"):
        model(np.zeros((1, 9), np.int64))
    with pytest.raises(ValueError, match=r"token id 20, but token ids must lie in \[0, 20\)"):
        model(np.array([[1, 20]]))
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate_text("hi", 2)


def test_a_sharded_folder_with_tokenizer_and_chat_template(tmp_path):
    """model.safetensors.index.json shards, tokenizer.json and tokenizer_config.json's chat
    template: the text methods run through the template."""
    import json

    from gguf_files import TEMPLATE, write_tiny_gguf

    pytest.importorskip("gguf")
    from attnlab.io.gguf import read_gguf

    tok = read_gguf(write_tiny_gguf(tmp_path / "t.gguf") and tmp_path / "t.gguf", tensors=False).tokenizer()
    folder = tmp_path / "m"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.LlamaConfig(**{**BASE, "vocab_size": tok.get_vocab_size()}, num_attention_heads=4,
                                       num_key_value_heads=2)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        hf.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ours = Llama.from_pretrained(folder)
    assert ours.chat_template == TEMPLATE
    prompt_text = ours.chat_prompt("hello")
    assert prompt_text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids, _ = ours.encode(prompt_text)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(ids[None]), max_new_tokens=5, do_sample=False, eos_token_id=2,
                           pad_token_id=0).numpy()[0, len(ids):].tolist()
    want = want[: want.index(2)] if 2 in want else want
    assert want  # something was generated before any end of sequence
    got = ours.generate_text("hello", 5)  # stops at the config's eos_token_id (2)
    assert got == tok.decode(want, skip_special_tokens=True)
    raw = ours.generate_text("hello", 2, chat=False)
    assert raw.startswith("hello")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("arch", "options"), [("llama", {"qtype": "Q8_0", "kv_heads": 1}),
                                               ("qwen2", {"qtype": "F16", "bias": True, "tied": False})])
def test_gguf_files_run_as_transformers_runs_them(tmp_path, arch, options):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from gguf_files import write_tiny_gguf

    write_tiny_gguf(tmp_path / "m.gguf", arch=arch, **options)
    ours = Llama.from_pretrained(tmp_path / "m.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, ours.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours(ids) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert ours.config.model_type == arch and ours.chat_template is not None


@pytest.mark.parametrize("case", ["llama-gqa3-llama3", "qwen3-qknorm", "qwen2-window-layer"])
def test_backward_through_every_block_matches_autograd(case, tmp_path):
    """The blocks' backward passes (RMSNorm, rotary positions, grouped-query attention,
    QK-norm, sliding window, SwiGLU) against torch autograd through the transformers model:
    the gradient of the embeddings' output and of the stacked q/k/v and gate weights.
    float64 (transformers computes RMSNorm and cos/sin in float32 even then: 1e-6 apart)."""

    def close(got, want):
        want = want.detach().numpy() if hasattr(want, "detach") else want
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())

    cls_name, options = CASES[case]
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls_name)(**{**BASE, **options}, attn_implementation="eager")
        hf = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.mul_(8.0) if not name.endswith("norm.weight") else p.add_(torch.randn_like(p) * 0.2)
        hf.save_pretrained(tmp_path)
    ours = Llama.from_pretrained(tmp_path, dtype=np.float64)
    hf = hf.double()
    rng = np.random.default_rng(6)
    ids = prompt(rng, 2, 12)
    g_logits = rng.standard_normal((2, 12, V))
    x0 = torch.tensor(ours.tok_emb.weight.data[ids], requires_grad=True)
    (hf(inputs_embeds=x0).logits * torch.from_numpy(g_logits)).sum().backward()
    ours.train()
    x = ours.tok_emb.weight.data[ids]
    for block in ours.layers:
        x = block(x)
    h = ours.ln_f(x)
    w_out = ours.tok_emb.weight.data if ours.config.tie_word_embeddings else ours.lm_head.weight.data
    close(h @ w_out.T, hf(inputs_embeds=x0).logits)
    g = ours.ln_f.backward(g_logits @ w_out)
    for block in reversed(ours.layers):
        g = block.backward(g)
    ours.eval()
    close(g, x0.grad)
    hp = dict(hf.named_parameters())
    for i in range(len(ours.layers)):
        a = f"model.layers.{i}.self_attn."
        want = torch.cat([hp[a + f"{p}_proj.weight"].grad for p in "qkv"]).numpy()
        close(ours.layers[i].attn.in_proj_weight.grad, want)
        close(ours.layers[i].mlp.gate_proj.weight.grad, hp[f"model.layers.{i}.mlp.gate_proj.weight"].grad)
        close(ours.layers[i].ln_1.weight.grad, hp[f"model.layers.{i}.input_layernorm.weight"].grad)
        if ours.config.qk_norm:
            close(ours.layers[i].attn.k_norm.weight.grad, hp[a + "k_norm.weight"].grad)
