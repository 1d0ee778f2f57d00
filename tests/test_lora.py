"""LoRA (attnlab.train.lora) against PEFT 0.21.2 on transformers' own random-weight Llama,
Qwen2 and GPT-2 models: the adapters' gradients (float64 within 1e-9), 20 AdamW steps of
the fine-tuning loop against torch + PEFT's (every loss and the final adapters), adapters
saved by attnlab loaded by PEFT and the other way round (logits within 1e-4 in float32),
frozen base weights, merge/unmerge, and the errors.

transformers' Llama-family code runs RMSNorm and the attention softmax in float32 even for
a float64 model: the float64 comparisons run it without those casts (tests/hf_oracle.py).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from attnlab.io.files import CheckpointError  # noqa: E402
from attnlab.models import from_pretrained  # noqa: E402
from attnlab.nn import functional as F  # noqa: E402
from attnlab.train import lora  # noqa: E402
from attnlab.train.finetune import FinetuneConfig, Finetuner, collate  # noqa: E402
from attnlab.train.optim import warmup_cosine  # noqa: E402
from helpers import TOL, grad_rel_err, random_examples, random_gpt2  # noqa: E402
from hf_oracle import V, batch, folder_maker, patch_eager, positions  # noqa: E402

# family -> (how the transformers model is made, the modules adapted)
CASES = {
    "llama": ("llama-gqa2-tied-llama3", ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "qwen2": ("qwen2-bias-tied-window", ["q_proj", "v_proj", "gate_proj", "up_proj"]),
    "gpt2": (None, ["c_attn", "c_proj", "c_fc"]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = folder_maker(tmp_path_factory)

    def get(family):
        case = CASES[family][0]
        if case is not None:
            return made(case)[1]
        folder = tmp_path_factory.getbasetemp() / "lora-gpt2"
        if not (folder / "config.json").exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                random_gpt2(folder, seed=5, n_layer=2, n_head=4, n_embd=32, vocab_size=V, n_positions=40)
        return folder

    return get


@pytest.fixture
def eager(monkeypatch):
    return patch_eager(monkeypatch)


def _hf(folder, dtype, eager):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    if dtype == np.float64:
        eager.float64()
        return hf.double()
    return hf.float()


def _ours_with_adapters(folder, dtype, targets, *, seed=0, alpha=8.0, **options):
    """attnlab's model with adapters whose B is random (so A gets a gradient too)."""
    ours = from_pretrained(folder, dtype=dtype)
    lora.add(ours, r=4, alpha=alpha, target_modules=targets, rng=np.random.default_rng(seed), **options)
    rng = np.random.default_rng(seed + 1)
    for a in lora.adapters(ours).values():
        a.lora_B.data[...] = rng.standard_normal(a.lora_B.shape) * 0.3
    return ours


def _peft(hf, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(hf, folder, is_trainable=True)


def _hf_logits(pm, ids, mask):
    return pm(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
              position_ids=torch.from_numpy(positions(mask))).logits


@pytest.mark.parametrize("family", sorted(CASES))
def test_lora_gradients_match_peft(family, folders, eager, tmp_path):
    """float64: the gradients of every lora_A and lora_B equal PEFT's within 1e-9 relative
    on a left-padded batch; the base weights are frozen (grad None) on both sides; saved
    names are PEFT's."""
    folder = folders(family)
    ours = _ours_with_adapters(folder, np.float64, CASES[family][1])
    lora.save_adapter(ours, tmp_path / "adapter")
    pm = _peft(_hf(folder, np.float64, eager), tmp_path / "adapter")
    rng = np.random.default_rng(2)
    ids, mask = batch(rng, T=9)
    g = rng.standard_normal((*ids.shape, V)) * mask[..., None]
    logits = ours.train()(ids, attention_mask=mask)
    ours.backward(g)
    want = _hf_logits(pm, ids, mask)
    (want * torch.from_numpy(g)).sum().backward()
    real = mask.astype(bool)
    assert np.abs(logits - want.detach().numpy())[real].max() <= 1e-10 * np.abs(logits).max()
    theirs = dict(pm.named_parameters())
    found = lora.adapters(ours)
    assert len(found) == sum(1 for n in theirs if n.endswith("lora_A.default.weight"))
    worst = 0.0
    for key, a in found.items():
        for ab in ("lora_A", "lora_B"):
            err = grad_rel_err(getattr(a, ab).grad, theirs[f"base_model.model.{key}.{ab}.default.weight"].grad.numpy())
            assert err <= TOL[np.float64], (key, ab, err)
            worst = max(worst, err)
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)
    print(f"{family}: worst LoRA gradient {worst:.1e} over {len(found)} adapters")


def _torch_steps(hf, ft, config):
    """torch's version of ``ft``'s run on ``hf`` (its trainable parameters): the same
    micro-batches, the loss over each step's answer tokens, clipping, AdamW with the same
    schedule. Returns every step's loss and gradient norm (before clipping)."""
    trainable = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=config.lr, betas=config.betas, eps=config.eps,
                            weight_decay=config.weight_decay)
    losses, norms = [], []
    for step in range(1, config.steps + 1):
        batches = [collate(b) for b in ft.micro_batches(step)]
        answers = sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in batches)
        total = 0.0
        for ids, mask, labels in batches:
            logits = _hf_logits(hf, ids, mask)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     torch.from_numpy(labels[:, 1:]).reshape(-1),
                                                     ignore_index=-100, reduction="sum") / answers
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, config.clip)))
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, lr=config.lr, steps=config.steps, warmup=config.warmup,
                                        min_lr_ratio=config.min_lr_ratio)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_twenty_adamw_steps_match_torch_peft(family, dtype, folders, eager, tmp_path):
    """The fine-tuning loop against torch + PEFT from the same start on the same batches
    (different lengths padded, the prompts masked, 2 micro-batches a step, AdamW with
    weight decay, warm-up and cosine decay, clipping that acts): every step's loss and the
    final adapters within 1e-6 (float64) and 1e-3 (float32)."""
    folder = folders(family)
    ours = _ours_with_adapters(folder, dtype, CASES[family][1])
    lora.save_adapter(ours, tmp_path / "adapter")
    pm = _peft(_hf(folder, dtype, eager), tmp_path / "adapter")
    config = FinetuneConfig(steps=20, batch_size=2, grad_accum=2, lr=3e-2, warmup=3, min_lr_ratio=0.1,
                            weight_decay=0.05, clip=0.5, seed=4)
    ft = Finetuner(ours, random_examples(1, n=6, vocab=V), config)
    history = ft.run()
    losses, norms = _torch_steps(pm, ft, config)
    tol = 1e-6 if dtype == np.float64 else 1e-3
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(history["loss"], losses, strict=True))
    assert loss_err <= tol, (history["loss"], losses)
    assert max(n for n in norms[:5]) > config.clip  # the clipping acted
    theirs = dict(pm.named_parameters())
    worst = 0.0
    for key, a in lora.adapters(ours).items():
        for ab in ("lora_A", "lora_B"):
            err = grad_rel_err(getattr(a, ab).data, theirs[f"base_model.model.{key}.{ab}.default.weight"].detach()
                               .numpy())
            worst = max(worst, err)
    assert worst <= tol, worst
    assert history["loss"][-1] < 0.8 * history["loss"][0]
    print(f"{family} {np.dtype(dtype).name}: losses within {loss_err:.1e}, adapters within {worst:.1e}")


@pytest.mark.parametrize("family", sorted(CASES))
def test_full_fine_tune_matches_torch(family, folders, eager, tmp_path):
    """Full fine-tuning (every parameter, the tied embedding included) with the same loop
    against torch's AdamW on transformers' model, float64: every step's loss, and every
    parameter after 10 steps (written by save_pretrained under transformers' names) within
    1e-6."""
    from attnlab.io.safetensors import load_tensors
    from attnlab.train.finetune import save_pretrained

    folder = folders(family)
    ours = from_pretrained(folder, dtype=np.float64)
    hf = _hf(folder, np.float64, eager)
    config = FinetuneConfig(method="full", steps=10, batch_size=2, grad_accum=2, lr=1e-3, warmup=3,
                            min_lr_ratio=0.1, weight_decay=0.05, clip=0.5, seed=4)
    ft = Finetuner(ours, random_examples(1, n=6, vocab=V), config)
    history = ft.run()
    losses, norms = _torch_steps(hf, ft, config)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(history["loss"], losses, strict=True))
    assert loss_err <= 1e-6, (history["loss"], losses)
    assert max(norms) > config.clip  # the clipping acted
    saved = load_tensors(save_pretrained(ours, tmp_path / "full") / "model.safetensors")
    theirs = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    worst = max(grad_rel_err(v, theirs[k]) for k, v in saved.items())
    assert worst <= 1e-6, worst
    moved = max(float(np.abs(saved[k] - v).max()) for k, v in load_tensors(folder / "model.safetensors").items()
                if k in saved)
    assert moved > 1e-4  # the weights did move
    print(f"{family} full fine-tune: losses within {loss_err:.1e}, {len(saved)} parameters within {worst:.1e}")


@pytest.mark.parametrize("family", sorted(CASES))
def test_saved_adapter_loads_in_peft_and_back(family, folders, eager, tmp_path):
    """float32: attnlab's saved adapter in PEFT gives attnlab's logits within 1e-4; a PEFT
    adapter (random B, rank_pattern, alpha_pattern, rank-stabilised scaling) loaded by
    attnlab gives PEFT's logits within 1e-4; the files have PEFT's names and config."""
    folder = folders(family)
    targets = CASES[family][1]
    ours = _ours_with_adapters(folder, np.float32, targets)
    lora.save_adapter(ours, tmp_path / "ours")
    hf = _hf(folder, np.float32, eager)
    pm = _peft(hf, tmp_path / "ours")
    rng = np.random.default_rng(3)
    ids, mask = batch(rng, T=10)
    real = mask.astype(bool)
    got = ours(ids, attention_mask=mask)
    with torch.no_grad():
        want = _hf_logits(pm, ids, mask).numpy()
    saved_err = np.abs(got - want)[real].max() / np.abs(want).max()
    assert saved_err <= 1e-4
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["fan_in_fan_out"] == (family == "gpt2")
    # PEFT's own adapter (its initialisation, B not zero), with per-module ranks and alphas
    hf2 = _hf(folder, np.float32, eager)
    first = sorted(lora.adapters(ours))[0]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, use_rslora=True,
                          rank_pattern={first: 2}, alpha_pattern={targets[-1]: 5},
                          fan_in_fan_out=family == "gpt2")
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(hf2, cfg)
    theirs.save_pretrained(tmp_path / "theirs")
    fresh = from_pretrained(folder, dtype=np.float32)
    lora.load_adapter(fresh, tmp_path / "theirs")
    assert lora.adapters(fresh)[first].r == 2
    with torch.no_grad():
        want = _hf_logits(theirs, ids, mask).numpy()
    got = fresh(ids, attention_mask=mask)
    base = from_pretrained(folder, dtype=np.float32)(ids, attention_mask=mask)
    assert np.abs(got - base)[real].max() > 1e-2  # the adapter changes the logits
    loaded_err = np.abs(got - want)[real].max() / np.abs(want).max()
    assert loaded_err <= 1e-4
    # merged: the same logits at the model's own cost; unmerged: back
    lora.merge(fresh)
    assert np.abs(fresh(ids, attention_mask=mask) - want)[real].max() <= 1e-4 * np.abs(want).max()
    lora.unmerge(fresh)
    with pytest.raises(ValueError, match="other ranks"):  # its ranks are not the file's
        lora.load_adapter(fresh, tmp_path / "ours")
    print(f"{family}: attnlab's adapter in PEFT: logits within {saved_err:.1e}; PEFT's in attnlab: {loaded_err:.1e} "
          "(relative to the largest logit)")


def test_load_adapter_into_model_with_other_adapters_is_refused(folders, tmp_path):
    folder = folders("llama")
    ours = _ours_with_adapters(folder, np.float32, ["q_proj"])
    lora.save_adapter(ours, tmp_path / "q")
    other = _ours_with_adapters(folder, np.float32, ["v_proj"])
    with pytest.raises(ValueError, match="other layers or of other ranks"):
        lora.load_adapter(other, tmp_path / "q")
    same = _ours_with_adapters(folder, np.float32, ["q_proj"], seed=5)
    lora.load_adapter(same, tmp_path / "q")  # same layers and ranks: the file's values
    for key, a in lora.adapters(same).items():
        np.testing.assert_array_equal(a.lora_A.data, lora.adapters(ours)[key].lora_A.data)


def test_fused_projection_adapts_only_the_rows_peft_adapts(folders):
    """Llama's q_proj is the query rows of attnlab's stacked in_proj_weight; GPT-2's c_attn
    is the whole fused matrix (as PEFT adapts it)."""
    llama = from_pretrained(folders("llama"))
    lora.add(llama, target_modules=["v_proj"])
    a = lora.adapters(llama)["model.layers.0.self_attn.v_proj"]
    attn = llama.layers[0].attn
    Dq, Dkv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    assert (a.start, a.stop, a.in_features) == (Dq + Dkv, Dq + 2 * Dkv, attn.embed_dim)
    gpt2 = from_pretrained(folders("gpt2"))
    with pytest.raises(ValueError, match="a string is a regular expression"):  # as in PEFT: fullmatch
        lora.add(gpt2, target_modules="c_attn")
    lora.add(gpt2, target_modules=r".*\.c_attn")
    a = lora.adapters(gpt2)["transformer.h.0.attn.c_attn"]
    assert (a.start, a.stop) == (0, 3 * gpt2.config.n_embd)
    assert sorted({k.rsplit(".", 1)[-1] for k in lora.adapters(gpt2)}) == ["c_attn"]
    lora.merge(gpt2)
    with pytest.raises(RuntimeError, match="unmerge"):
        gpt2.train()(np.array([[1, 2, 3]]))


def test_frozen_weights_cost_no_gradient(folders, monkeypatch):
    """With LoRA no weight gradient of the base is computed (every linear backward is asked
    for the input's gradient alone) and a frozen linear layer keeps no input for backward
    unless an adapter reads it."""
    from attnlab.nn import _context

    calls = []
    real = F.linear_backward

    def spy(*args, weight_grad=True, **kwargs):
        calls.append(weight_grad)
        return real(*args, weight_grad=weight_grad, **kwargs)

    monkeypatch.setattr(F, "linear_backward", spy)
    model = from_pretrained(folders("qwen2"), dtype=np.float64)
    lora.add(model, target_modules=["q_proj", "down_proj"])
    model.train()
    ids = np.array([[3, 4, 5, 6]])
    logits = model(ids)
    tape = _context.tape()
    mlp = model.layers[0].mlp
    assert tape.peek(mlp.up_proj, missing="", freed="")["x"] is None  # frozen, no adapter
    assert tape.peek(model.layers[0].attn.out_proj, missing="", freed="")["x"] is None
    model.backward(np.ones_like(logits))
    assert calls and not any(calls)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_adapters_beside_quantized_weights_in_the_decoding_step():
    """A model kept quantized runs its adapters too: the compiled decoding step (which
    computes no adapters) stands aside, so cached decoding equals the full forward pass."""
    pytest.importorskip("numba")
    from test_decode_step import quantized_llama

    model = quantized_llama("Q8_0")
    ids = np.array([[5, 9, 17, 33, 2, 41]])
    plain = model.generate(ids, 6)  # builds the compiled step's plan without adapters
    lora.add(model, target_modules="all-linear", rng=np.random.default_rng(0))
    for a in lora.adapters(model).values():
        a.lora_B.data[...] = np.random.default_rng(1).standard_normal(a.lora_B.shape)
    out = model.generate(ids, 6)
    assert not np.array_equal(out, plain)
    full = model(out[:, :-1])  # every step's greedy choice, from the whole sequence at once
    np.testing.assert_array_equal(full[0, ids.shape[1] - 1:].argmax(-1), out[0, ids.shape[1]:])
    with pytest.raises(TypeError, match="quantized"):
        lora.merge(model)


def test_bad_input(folders, tmp_path):
    folder = folders("llama")
    model = from_pretrained(folder)
    with pytest.raises(ValueError, match=r"match no linear layer.*q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                         r"up_proj, down_proj \(e\.g\. model\.layers\.0\.self_attn\.q_proj\)"):
        lora.add(model, target_modules=["query"])
    with pytest.raises(ValueError, match="r must be a positive int"):
        lora.add(model, r=0)
    with pytest.raises(ValueError, match="r must be a positive int"):
        lora.add(model, r=-2)
    with pytest.raises(ValueError, match="alpha"):
        lora.add(model, alpha=0)
    with pytest.raises(ValueError, match="no adapters"):
        lora.merge(model)
    assert all(p.requires_grad for p in model.parameters())  # nothing changed by the refusals
    # an adapter for another model: the shapes named
    gpt2 = from_pretrained(folders("gpt2"))
    lora.add(gpt2, target_modules=["c_attn"])
    lora.save_adapter(gpt2, tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match="for another model.*transformer.h.0.attn.c_attn is not a linear layer"):
        lora.load_adapter(model, tmp_path / "gpt2")
    wide = from_pretrained(folders("qwen2"))
    lora.add(wide, target_modules=["q_proj"])
    lora.save_adapter(wide, tmp_path / "qwen2")
    small = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    other = from_pretrained(tmp_path / "small")
    with pytest.raises(CheckpointError, match=r"lora_A.weight has shape \(8, 32\), but this Llama's "
                                              r"model.layers.0.self_attn.q_proj needs \(8, 16\)"):
        lora.load_adapter(other, tmp_path / "qwen2")
    assert not lora.adapters(other)  # nothing half-loaded
    config = json.loads((tmp_path / "qwen2" / "adapter_config.json").read_text())
    (tmp_path / "qwen2" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora=True is not supported"):
        lora.load_adapter(from_pretrained(folders("qwen2")), tmp_path / "qwen2")
    with pytest.raises(FileNotFoundError):
        lora.load_adapter(model, tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        lora.save_adapter(wide, tmp_path / "file")


# ---- adapters in every route of the attention's in-projection ---------------------------
def _tiny_with_adapters(family, dropout=0.0):
    """A random float64 attnlab Llama (grouped queries) or GPT-2 (one c_attn adapter over
    q, k and v) with attention adapters whose B is random."""
    from attnlab.models import GPT2, GPT2Config, Llama, LlamaConfig

    if family == "llama":
        model = Llama(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2),
                      rng=np.random.default_rng(0), dtype=np.float64)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
    else:
        model = GPT2(GPT2Config(vocab_size=V, n_layer=2, n_head=4, n_embd=16, n_positions=16),
                     rng=np.random.default_rng(0), dtype=np.float64)
        names = ("c_attn", "c_proj")
    lora.add(model, r=3, alpha=6, dropout=dropout, target_modules=names, rng=np.random.default_rng(1))
    rng = np.random.default_rng(2)
    for a in lora.adapters(model).values():
        a.lora_B.data[...] = rng.standard_normal(a.lora_B.shape) * 0.3
    return model.train()


def _run_with_hooks(model, ids, g, hooks=()):
    for p in model.parameters():
        p.grad = None
    with model.hooks(fwd_hooks=list(hooks)):
        out = model(ids)
        model.backward(g)
    return out, {k: (a.lora_A.grad, a.lora_B.grad) for k, a in lora.adapters(model).items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adapters_on_per_head_inputs(family):
    """A hook on hook_q/k/v_input gives each head its own input: the adapters then act on
    each head's input with that head's rows (forward equal to the merged model's, A's and
    B's gradients equal to finite differences through a patched head); with hooks that
    change nothing, logits and gradients equal the call without them, dropout included."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, V, (2, 5))
    g = rng.standard_normal((2, 5, V))
    split = [(f"blocks.{i}.hook_{p}_input", lambda a, name: None) for i in range(2) for p in "qkv"]
    for dropout in (0.0, 0.25):
        want, want_grads = _run_with_hooks(_tiny_with_adapters(family, dropout), ids, g)
        got, got_grads = _run_with_hooks(_tiny_with_adapters(family, dropout), ids, g, split)
        assert np.abs(got - want).max() <= 1e-12
        assert max(np.abs(got_grads[k][i] - want_grads[k][i]).max() for k in want_grads for i in (0, 1)) <= 1e-12
    patch = rng.standard_normal((2, 5, 16))

    def patched(a, name):  # head 1 reads a constant: the gradient stops there
        a[:, :, 1] = patch

    hooks = [("blocks.0.hook_k_input", patched), ("blocks.1.hook_q_input", patched),
             ("blocks.1.hook_v_input", patched)]
    model = _tiny_with_adapters(family)
    out, grads = _run_with_hooks(model, ids, g, hooks)
    merged = lora.merge(_tiny_with_adapters(family))
    with merged.eval().hooks(fwd_hooks=hooks):
        assert np.abs(out - merged(ids)).max() <= 1e-12 * np.abs(out).max()

    def loss():
        with model.hooks(fwd_hooks=hooks):
            return float((model(ids) * g).sum())

    worst, eps = 0.0, 1e-5
    for key, a in lora.adapters(model).items():
        for i, p in enumerate((a.lora_A, a.lora_B)):
            d = rng.standard_normal(p.shape)
            p.data += eps * d
            up = loss()
            p.data -= 2 * eps * d
            down = loss()
            p.data += eps * d
            fd = (up - down) / (2 * eps)
            worst = max(worst, abs(float((grads[key][i] * d).sum()) - fd) / max(1.0, abs(fd)))
    assert worst <= 1e-6, worst
    print(f"{family}: per-head adapter gradients within {worst:.1e} of finite differences")


@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}])
def test_adapters_give_each_input_its_gradient(extra):
    """A MultiheadAttention (self-attention through the fused in-projection, or with extra
    keys) with adapters on its query and value rows: the gradients of query, key and value
    each equal the merged layer's, and the adapters' equal the merged weight's through B
    and A (chain rule: dW_merged = scaling * ...)."""
    from attnlab.nn import MultiheadAttention
    from attnlab.nn.adapters import Adapters, LoRA

    E, H = 8, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, E))
    g = rng.standard_normal((2, 5, E))

    def layer():
        return MultiheadAttention(E, H, batch_first=True, rng=np.random.default_rng(1), dtype=np.float64,
                                  **extra).train()

    mha = layer()
    mha.adapters = Adapters()
    mha.adapters.q = LoRA(E, E, r=2, alpha=4, rng=np.random.default_rng(2), dtype=np.float64)
    mha.adapters.v = LoRA(E, E, r=2, alpha=4, start=2 * E, rng=np.random.default_rng(3), dtype=np.float64)
    for a in mha.adapters.loras():
        a.lora_B.data[...] = rng.standard_normal(a.lora_B.shape)
    ref = layer()
    for a in mha.adapters.loras():
        ref.in_proj_weight.data[a.start:a.stop] += a.delta_weight()
    out, _ = mha(x, x, x, need_weights=False)
    want, _ = ref(x, x, x, need_weights=False)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    grads, wanted = mha.backward(g), ref.backward(g)
    for got, exp in zip(grads, wanted, strict=True):
        np.testing.assert_allclose(got, exp, rtol=0, atol=1e-12)
    gw = ref.in_proj_weight.grad
    for a in mha.adapters.loras():
        gd = gw[a.start:a.stop] * a.scaling  # d loss / d (B A) rows
        np.testing.assert_allclose(a.lora_B.grad, gd @ a.lora_A.data.T, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.lora_A.grad, a.lora_B.data.T @ gd, rtol=0, atol=1e-12)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "per-head"])
def test_frozen_parameters_keep_the_adapters_input_gradient(split):
    """In the gradient methods' context (frozen_parameters: activations' gradients only) a
    model with adapters gives the residual stream the gradient it gets in training (the
    adapters' term included) and no parameter, adapter or base, gets a .grad."""
    from attnlab.nn import _context

    rng = np.random.default_rng(4)
    ids = rng.integers(0, V, (2, 5))
    g = rng.standard_normal((2, 5, V))
    seen = {}
    hooks = [(f"blocks.{i}.hook_q_input", lambda a, name: None) for i in range(2)] if split else []

    def grab(grad, name):
        seen[name] = grad.copy()

    bwd = [("blocks.0.hook_resid_pre", grab)]
    model = _tiny_with_adapters("llama")
    with model.hooks(fwd_hooks=hooks, bwd_hooks=bwd):
        model(ids)
        model.backward(g)
    want = seen.pop("blocks.0.hook_resid_pre")
    for p in model.parameters():
        p.grad = None
    with _context.frozen_parameters(), model.hooks(fwd_hooks=hooks, bwd_hooks=bwd):
        model(ids)
        model.backward(g)
    np.testing.assert_allclose(seen["blocks.0.hook_resid_pre"], want, rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
