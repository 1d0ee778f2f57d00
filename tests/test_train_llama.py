"""The Llama-style TinyTransformer (rotary positions, RMSNorm, SwiGLU, grouped-query heads):
every parameter gradient against torch autograd, a short training run that learns
associative recall to >= 99%, its hook points, its checkpoints (old GPT-style ones still
load) and ``attnlab train --arch llama``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.core.rotary import RopeConfig, apply_rotary, rope_cos_sin, rope_inv_freq
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.nn import CrossEntropyLoss
from attnlab.train import checkpoint as ckpt
from attnlab.train.loop import TrainConfig, Trainer, answer_accuracy
from attnlab.train.sizes import parameter_count
from attnlab.train.tasks import RecallTask
from helpers import TOL  # noqa: E402
from helpers import grad_rel_err as rel_err  # noqa: E402

TASK = RecallTask(num_keys=8, num_values=8, num_pairs=4, num_queries=4)  # 16 tokens


def llama(dtype="float64", **overrides):
    shape = dict(vocab_size=TASK.vocab_size, context_length=TASK.seq_len, d_model=16, n_heads=4, d_ff=24)
    return TinyTransformerConfig.llama(**{**shape, "dtype": dtype, **overrides})


def perturbed(cfg, seed=0):
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # move the norms' weights off their ones
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return model


# ---- the config ---------------------------------------------------------------------------
def test_defaults_are_the_gpt_style_model_and_llama_sets_every_slot():
    c = TinyTransformerConfig()
    assert (c.position, c.norm, c.mlp, c.n_kv_heads, c.norm_eps, c.arrangement) == \
        ("learned", "layernorm", "standard", None, 1e-5, "gpt")
    model = TinyTransformer(TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32))
    assert "pos_emb.weight" in model.state_dict() and "blocks.0.mlp.0.weight" in model.state_dict()
    c = llama()
    assert (c.position, c.norm, c.mlp, c.activation, c.bias, c.kv_heads, c.arrangement) == \
        ("rotary", "rmsnorm", "gated", "silu", False, 2, "llama")
    names = TinyTransformer(c).state_dict()
    assert "pos_emb.weight" not in names and "blocks.0.mlp.gate_proj.weight" in names
    assert names["blocks.0.attn.in_proj_weight"].shape == ((4 + 2 * 2) * 4, 16)  # 4 q heads, 2 k, 2 v


@pytest.mark.parametrize("bad,match", [
    (dict(position="alibi"), "position must be one of 'learned', 'rotary', got 'alibi'"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(mlp="moe"), "mlp must be one of"),
    (dict(n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
    (dict(mlp="standard"), "activation must be one of 'gelu', 'gelu_tanh', 'relu' with mlp='standard', got 'silu'"),
    (dict(d_model=12, n_heads=4, n_kv_heads=None), "rotary positions need an even head size"),
    (dict(norm_eps=0.0), "norm_eps must be a positive finite number"),
    (dict(rope_theta=1.0), "rope_theta must be > 1"),
])
def test_bad_configs_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        llama(**bad)


@pytest.mark.parametrize("overrides", [{}, dict(bias=True), dict(n_kv_heads=1), dict(position="learned"),
                                       dict(norm="layernorm"), dict(mlp="standard", activation="gelu")])
def test_parameter_count_is_the_models(overrides):
    cfg = llama("float32", **overrides)
    assert parameter_count(cfg) == sum(p.data.size for p in TinyTransformer(cfg).parameters())


def test_cache_trace_and_inspect_on_the_llama_style_model():
    """Rotary positions continue through the KV cache (also left-padded); trace and inspect
    read the same attention."""
    model = perturbed(llama()).eval()
    ids = TASK.sample(2, rng=np.random.default_rng(5))[0][:, :12]
    full = model(ids)
    cache = model.new_cache()
    stepped = np.concatenate([model(ids[:, :7], cache=cache)] +
                             [model(ids[:, t : t + 1], cache=cache) for t in range(7, 12)], axis=1)
    assert np.abs(stepped - full).max() <= 1e-12
    padded = np.concatenate([np.zeros((2, 3), np.int64), ids[:, :9]], axis=1)
    mask = np.concatenate([np.zeros((2, 3), bool), np.ones((2, 9), bool)], axis=1)
    np.testing.assert_allclose(model(padded, mask)[:, 3:], model(ids[:, :9]), atol=1e-12)
    t = model.trace(ids[0], layer=2, head=1)
    np.testing.assert_array_equal(t.get("weights", 1), model.inspect(ids[0])["attentions"][1, 1])


# ---- gradients against torch autograd ---------------------------------------------------------
torch = pytest.importorskip("torch", reason="torch is the test oracle for training")


SHAPES = [
    {},                                                    # GQA 4 query heads over 2
    dict(n_kv_heads=1),                                    # multi-query
    dict(n_kv_heads=4),                                    # every head its own keys
    dict(bias=True, activation="gelu_tanh"),               # biases, a GeGLU-style gate
    dict(position="learned"),                              # learned positions, the other Llama slots
    dict(norm="layernorm", mlp="standard", activation="relu", position="learned", n_kv_heads=2),  # GPT + GQA
]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("overrides", SHAPES)
def test_llama_style_gradients_match_torch_autograd(dtype, overrides):
    from attnlab.models.tiny_torch import copy_to_torch, torch_tiny_transformer

    cfg = llama(dtype, **overrides)
    model = perturbed(cfg)
    twin = torch_tiny_transformer(cfg)
    copy_to_torch(model, twin)
    ids, targets = TASK.sample(3, rng=np.random.default_rng(2))
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(model(ids), targets)
    model.zero_grad()
    model.backward(loss_fn.backward())
    logits = twin(torch.from_numpy(ids))
    t_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               torch.from_numpy(targets).reshape(-1))
    t_loss.backward()
    tol = TOL[np.dtype(dtype).type]
    assert abs(loss - t_loss.item()) <= tol * abs(t_loss.item())
    tparams = dict(twin.named_parameters())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(tparams)
    worst = max(rel_err(p.grad, tparams[name].grad.numpy()) for name, p in model.named_parameters())
    assert worst <= tol
    print(f"{dtype} {overrides}: worst gradient error vs autograd {worst:.2e}")


# ---- it learns associative recall --------------------------------------------------------------
# Measured on 2 shared cores: 19-49 s, held-out accuracy 100% (seed 0). A short recipe: of
# seeds 0-4, 0, 3 and 4 pass 99% within these 300 steps, 1 and 2 are still on the 50% plateau
# (the GPT-style model with this recipe is on it at seeds 0 and 1). attnlab train --arch llama
# (1000 steps, the default task) reaches 99.98%.
RECIPE = dict(steps=300, batch_size=32, lr=3e-3, warmup=30, seed=0, eval_size=2000)


@pytest.fixture(scope="module")
def trained():
    cfg = TinyTransformerConfig.llama(d_model=64, d_ff=128, n_heads=4, n_layers=2)
    trainer = Trainer.build(TASK, cfg, TrainConfig(**RECIPE))
    start = time.perf_counter()
    for _ in range(RECIPE["steps"]):
        trainer.train_step()
    seconds = time.perf_counter() - start
    loss, acc = trainer.evaluate()
    print(f"Llama-style recall: held-out accuracy {acc:.4%} (loss {loss:.4f}) after {trainer.step} steps "
          f"in {seconds:.1f} s")
    return trainer, acc


def test_llama_style_model_learns_recall_to_99_percent(trained):
    trainer, acc = trained
    c = trainer.model.config
    assert (c.position, c.norm, c.mlp, c.kv_heads, c.n_heads) == ("rotary", "rmsnorm", "gated", 2, 4)
    assert acc >= 0.99
    assert trainer.history["accuracy"][0] < 0.5  # it started from chance


def test_hooks_on_the_trained_model(trained):
    """hook_q/k/v, hook_rot_q/k (the rotated heads), hook_pattern on the grouped-query rotary
    attention; replacing the rotated keys changes what the model answers."""
    trainer, _ = trained
    model = trainer.model.eval()
    ids, targets = trainer.heldout[0][:50], trainer.heldout[1][:50]
    logits, cache = model.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.1.attn."))
    # The hooked pattern takes the weights path in block 1, the plain call the fast kernel
    # (from 2^15 scores): equal to float32 rounding.
    np.testing.assert_allclose(logits, model(ids), rtol=1e-5, atol=1e-5)
    B, T = ids.shape
    assert cache["blocks.1.attn.hook_q"].shape == cache["blocks.1.attn.hook_rot_q"].shape == (B, T, 4, 16)
    assert cache["blocks.1.attn.hook_k"].shape == cache["blocks.1.attn.hook_rot_k"].shape == (B, T, 2, 16)
    assert cache["blocks.1.attn.hook_pattern"].shape == (B, 4, T, T)
    # hook_rot_q is hook_q rotated by position (Hugging Face's split halves)
    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(16))[0], np.arange(T))
    q = cache["blocks.1.attn.hook_q"].transpose(0, 2, 1, 3)  # (B, T, H, D) -> (B, H, T, D)
    want = apply_rotary(q, cos, sin).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(cache["blocks.1.attn.hook_rot_q"], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(cache["blocks.1.attn.hook_rot_q"][:, 1:], cache["blocks.1.attn.hook_q"][:, 1:])
    # undo the rotation of layer 2's keys: the recall lookup by position breaks
    seen = []
    patched = model.run_with_hooks(ids, fwd_hooks=[
        ("blocks.1.attn.hook_rot_k", lambda x, name: seen.append(name) or np.zeros_like(x))])
    assert seen == ["blocks.1.attn.hook_rot_k"]
    assert answer_accuracy(logits, targets) >= 0.99
    assert answer_accuracy(patched, targets) < 0.5
    assert "blocks.0.attn.hook_rot_k" in model.hook_names() and "hook_pos_embed" not in model.hook_names()


def test_llama_style_checkpoint_round_trip(trained, tmp_path):
    trainer, _ = trained
    path = tmp_path / "llama.npz"
    ckpt.save_checkpoint(path, trainer.model, trainer.task, meta={"step": trainer.step})
    model, task, meta = ckpt.load_checkpoint(path)
    assert model.config == trainer.model.config and task == TASK and meta == {"step": 300}
    ids = trainer.heldout[0][:4]
    np.testing.assert_array_equal(model.eval()(ids), trainer.model.eval()(ids))


def test_old_gpt_style_checkpoint_still_loads(tmp_path):
    """A checkpoint written before the Llama-style fields existed (its header's config has
    only the old fields) loads as the GPT-style model, with the same logits."""
    import zipfile

    cfg = TinyTransformerConfig(vocab_size=TASK.vocab_size, context_length=TASK.seq_len, d_model=16, d_ff=24)
    model = perturbed(cfg, seed=3)
    path = tmp_path / "old.npz"
    old_fields = ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "d_ff", "dropout",
                  "activation", "bias", "dtype")
    header = {"format": ckpt.FORMAT, "model": {k: v for k, v in cfg.to_dict().items() if k in old_fields},
              "task": {"name": "recall", **TASK.to_dict()}, "meta": {"step": 7}}
    np.savez(path, **model.state_dict(), **{ckpt.META_KEY: np.array(json.dumps(header))})
    with zipfile.ZipFile(path) as zf:
        stored = json.loads(str(np.load(zf.open(ckpt.META_KEY + ".npy"))[()]))
    assert set(stored["model"]) == set(old_fields)
    back, task, meta = ckpt.load_checkpoint(path)
    assert back.config == cfg and back.config.arrangement == "gpt" and meta == {"step": 7}
    ids = TASK.sample(2, rng=np.random.default_rng(0))[0]
    np.testing.assert_array_equal(back.eval()(ids), model.eval()(ids))


# ---- the CLI ---------------------------------------------------------------------------------
def test_cli_train_arch_llama(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--arch", "llama", "--heads", "4", "--kv-heads", "1", "--d-model", "16", "--steps", "3",
                 "--num-keys", "8", "--num-values", "8", "--num-pairs", "4", "--num-queries", "4",
                 "--eval-every", "3", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3
    assert {k: metrics["model"][k] for k in ("position", "norm", "mlp", "activation", "n_kv_heads", "d_ff")} == \
        {"position": "rotary", "norm": "rmsnorm", "mlp": "gated", "activation": "silu", "n_kv_heads": 1, "d_ff": 32}
    model, task, _ = ckpt.load_checkpoint(out / "checkpoint.npz")
    assert model.config.arrangement == "llama" and model.layers[0].attn.num_kv_heads == 1
    capsys.readouterr()
    assert main(["train", "--arch", "llama", "--heads", "4", "--kv-heads", "3", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-heads must divide --heads (4), got '3'" in err
