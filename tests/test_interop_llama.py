"""The Llama family to torch and back: attnlab's Llama as transformers' LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (and those, built by transformers,
as attnlab's Llama) with equal logits over several shapes (MHA, GQA 2 and 3, MQA, rope
scalings, sliding windows, tied and untied embeddings, Qwen2's biases, Qwen3's QK-norm); the
Llama-style TinyTransformer as a torch module; both training under DistributedDataParallel
(two CPU processes, gloo on 127.0.0.1) with the gradients of a single-process run."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnlab.interop import from_torch, llama_hf_config, to_torch  # noqa: E402
from attnlab.models import TinyTransformer, TinyTransformerConfig  # noqa: E402
from attnlab.models.llama import Llama, LlamaConfig  # noqa: E402

V = 61
BASE = dict(vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=32,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# id -> attnlab LlamaConfig options
CASES = {
    "llama-mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama-gqa2-bias": dict(num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, out_bias=True,
                            mlp_bias=True),
    "llama-gqa3-llama3": dict(num_attention_heads=6, num_key_value_heads=2, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
    "llama-mqa-linear": dict(num_attention_heads=4, num_key_value_heads=1,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-yarn": dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "mistral-window": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2,
                           sliding_windows=(5, 5)),
    "qwen2-bias-tied": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, qkv_bias=True,
                            tie_word_embeddings=True),
    "qwen2-window-layer": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, qkv_bias=True,
                               sliding_windows=(None, 4)),
    "qwen3-qknorm": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         qk_norm=True, rope_theta=1000000.0),
}
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM"}
TOL = 1e-5  # max abs logit error relative to the largest logit
# float64 models too: transformers' RMSNorm and rotary tables compute in float32 whatever the dtype


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def make_llama(case: str, dtype=np.float32, seed=0) -> Llama:
    model = Llama(LlamaConfig(**{**BASE, **CASES[case]}), rng=np.random.default_rng(seed), dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for name, p in model.named_parameters():  # norms off their ones, weights large enough to matter
        if name.endswith("norm.weight") or ".ln_" in name or name == "ln_f.weight":
            p.data += (rng.standard_normal(p.shape) * 0.2).astype(dtype)
        else:
            p.data[...] = (rng.standard_normal(p.shape) * 0.3).astype(dtype)
    return model


def hf_logits(module, ids) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(ids)).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_to_torch_is_the_transformers_class_with_equal_logits(case):
    model = make_llama(case)
    module = to_torch(model)
    assert type(module) is getattr(transformers, CLASSES[model.config.model_type])
    assert not module.training
    ids = np.random.default_rng(2).integers(3, V, (2, 12))  # longer than every sliding window
    want = model(ids)
    got = hf_logits(module, ids)
    assert got.dtype == np.float32 and np.abs(want).max() > 1.0
    err = rel_error(got, want)
    assert err <= TOL, (case, err)
    print(f"{case}: to_torch logits error {err:.2e}")
    if model.config.tie_word_embeddings:
        assert module.lm_head.weight.data_ptr() == module.model.embed_tokens.weight.data_ptr()
    back = from_torch(module)
    assert isinstance(back, Llama) and back.config.model_type == model.config.model_type
    assert list(back.state_dict()) == list(model.state_dict())
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], w)
    for field in ("num_attention_heads", "kv_heads", "head_size", "qkv_bias", "out_bias", "mlp_bias", "rope",
                  "qk_norm", "tie_word_embeddings", "sliding_windows", "rope_theta", "rms_norm_eps"):
        assert getattr(back.config, field) == getattr(model.config, field), (case, field)
    np.testing.assert_array_equal(back(ids), want)


@pytest.mark.parametrize("case", ["llama-gqa2-bias", "qwen3-qknorm", "mistral-window"])
def test_llama_to_torch_float64(case):
    model = make_llama(case, np.float64, seed=4)
    module = to_torch(model)
    ids = np.random.default_rng(5).integers(3, V, (2, 10))
    got = hf_logits(module, ids)
    assert got.dtype == np.float64
    assert rel_error(got, model(ids)) <= TOL


# transformers-built models: (config class, options) as transformers names them
HF_CASES = {
    "llama-gqa2-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mqa-bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True)),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=3, sliding_window=4)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-qknorm-tied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              tie_word_embeddings=True)),
}


def make_hf(case: str, dtype=torch.float32):
    cls_name, options = HF_CASES[case]
    torch.manual_seed(sorted(HF_CASES).index(case))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, cls_name)(**{**BASE, **options})
        module = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    return module


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_transformers_models_come_back_as_llama_with_equal_logits(case):
    module = make_hf(case)
    model = from_torch(module)
    assert isinstance(model, Llama)
    assert model.config.model_type == module.config.model_type
    assert model.config.kv_heads == module.config.num_key_value_heads
    assert model.config.tie_word_embeddings == module.config.tie_word_embeddings
    ids = np.random.default_rng(6).integers(3, V, (2, 11))
    want = hf_logits(module, ids)
    err = rel_error(model(ids), want)
    assert err <= TOL, (case, err)
    print(f"{case}: from_torch logits error {err:.2e}")
    again = to_torch(model)  # and out again: the same tensors
    theirs = module.state_dict()
    for name, t in again.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), theirs[name].numpy())


def test_weights_trained_in_torch_come_back_and_wrappers_are_unwrapped():
    model = make_llama("llama-gqa2-bias", np.float64, seed=7)
    module = to_torch(model)
    module.train()
    ids = torch.from_numpy(np.random.default_rng(8).integers(3, V, (2, 9)))
    module(ids).logits.square().mean().backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.5 * p.grad
    module.eval()
    back = from_torch(torch.nn.DataParallel(module))
    assert isinstance(back, Llama)
    moved = [not np.array_equal(back.state_dict()[n], w) for n, w in model.state_dict().items()]
    assert all(moved)
    assert rel_error(back(ids.numpy()), hf_logits(module, ids.numpy())) <= TOL


def test_what_transformers_cannot_express_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLM has no sliding window; this llama config has it"):
        llama_hf_config(LlamaConfig(**{**BASE, "num_attention_heads": 4, "sliding_windows": (4, 4)}))
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM has no qkv_bias=False, out_bias=False"):
        llama_hf_config(LlamaConfig(**{**BASE, "num_attention_heads": 4, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match="one window size"):
        llama_hf_config(LlamaConfig(**{**BASE, "num_attention_heads": 4, "model_type": "mistral",
                                       "sliding_windows": (4, 6)}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        headless = transformers.LlamaModel(transformers.LlamaConfig(**{**BASE, "num_attention_heads": 4}))
    with pytest.raises(TypeError, match=r"from_torch supports .*LlamaForCausalLM.*got LlamaModel"):
        from_torch(headless)


# ---- the Llama-style TinyTransformer as a torch module ---------------------------------------
def make_tiny(dtype="float64", seed=0, **overrides) -> TinyTransformer:
    cfg = TinyTransformerConfig.llama(vocab_size=11, context_length=8, d_model=16, n_heads=4, d_ff=24, dtype=dtype,
                                      **overrides)
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return model


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("overrides", [{}, dict(n_kv_heads=1, bias=True)])
def test_llama_style_tiny_transformer_to_torch_and_back(dtype, overrides):
    model = make_tiny(dtype, **overrides)
    module = to_torch(model)
    assert list(module.state_dict()) == list(model.state_dict())
    ids = np.random.default_rng(3).integers(0, 11, size=(3, 8))
    with torch.no_grad():
        logits = module(torch.from_numpy(ids)).numpy()
    assert rel_error(logits, model(ids)) <= {"float64": 1e-12, "float32": 1e-5}[dtype]
    back = from_torch(module)
    assert isinstance(back, TinyTransformer) and back.config == model.config
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], w)


# ---- DistributedDataParallel: two processes on this machine ----------------------------------
STEPS, BATCH, WORLD, LR = 2, 4, 2, 0.1
DDP_CASES = ("llama", "tiny-llama")


def ddp_model(kind: str):
    """The attnlab model of a DDP case, exported to torch: a GQA Llama with QK-norm-free
    untied weights as a LlamaForCausalLM, or the Llama-style TinyTransformer."""
    if kind == "llama":
        return to_torch(make_llama("llama-gqa2-bias", np.float64, seed=9))
    return to_torch(make_tiny(seed=9))


def logits_of(module, ids):
    out = module(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def train(module, parameters, vocab, rank=0, world=1):
    """STEPS SGD steps on this rank's share of each batch; the gradients of every step."""
    rng = np.random.default_rng(7)
    data = [(rng.integers(3, vocab, size=(BATCH, 8)), rng.integers(0, vocab, size=(BATCH, 8))) for _ in range(STEPS)]
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    share = BATCH // world
    grads = []
    for ids, targets in data:
        rows = slice(rank * share, (rank + 1) * share)
        logits = logits_of(module, torch.from_numpy(ids[rows]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(targets[rows]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        grads.append({name: p.grad.numpy().copy() for name, p in parameters()})
        opt.step()
    return grads


def vocab_of(kind: str) -> int:
    return V if kind == "llama" else 11


def ddp_worker(rank: int, kind: str, init_method: str, out: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        module = ddp_model(kind)
        module.train()
        ddp = DistributedDataParallel(module)
        grads = train(ddp, module.named_parameters, vocab_of(kind), rank, WORLD)
        saved = {f"{step}/{k}": g for step, gs in enumerate(grads) for k, g in gs.items()}
        saved.update({f"final/{k}": w for k, w in from_torch(ddp).state_dict().items()})
        np.savez(f"{out}/rank{rank}.npz", **saved)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", DDP_CASES)
def test_ddp_two_processes_match_one_process(kind, tmp_path, monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    import torch._dynamo  # noqa: F401  (imported once in this process)

    method = "spawn"  # not fork: a child forked after the suite's thread pools can inherit a held lock
    mp.start_processes(ddp_worker, args=(kind, f"tcp://127.0.0.1:{port}", str(tmp_path)), nprocs=WORLD,
                       start_method=method)

    module = ddp_model(kind)
    module.train()
    want = train(module, module.named_parameters, vocab_of(kind))
    final = from_torch(module).state_dict()
    for rank in range(WORLD):
        got = np.load(tmp_path / f"rank{rank}.npz")
        keys = [f"{step}/{k}" for step in range(STEPS) for k in want[step]] + [f"final/{k}" for k in final]
        assert sorted(got.files) == sorted(keys)
        for step in range(STEPS):
            for name, g in want[step].items():
                assert rel_error(got[f"{step}/{name}"], g) <= 1e-12, (kind, rank, step, name)
        for name, w in final.items():  # the trained weights, back in attnlab
            assert rel_error(got[f"final/{name}"], w) <= 1e-12, (kind, rank, name)
