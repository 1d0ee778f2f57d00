"""Whole models to torch and back: TinyTransformer as a torch module with the same outputs and
state_dict names, and that module training under DistributedDataParallel (two CPU processes,
gloo on 127.0.0.1) with the gradients of a single-process run; BertEncoder as a transformers
BertModel with equal hidden states."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.interop import from_torch, to_torch
from attnlab.io.names import bert_name_map
from attnlab.models import TinyTransformer, TinyTransformerConfig
from attnlab.models.bert import BertConfig, BertEncoder, minilm_available, shared_minilm
from attnlab.nn import GELU

torch = pytest.importorskip("torch")

TOL = {"float64": 1e-12, "float32": 1e-5}  # max abs error relative to the largest reference entry


def make_model(dtype="float64", activation="gelu", bias=True, seed=0):
    cfg = TinyTransformerConfig(
        vocab_size=11, context_length=8, d_model=16, n_heads=2, n_layers=2, d_ff=24,
        activation=activation, bias=bias, dtype=dtype,
    )
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # move LayerNorm/bias off their ones/zeros
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return model


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("activation,bias", [("gelu", True), ("gelu_tanh", False), ("relu", True)])
def test_tiny_transformer_to_torch_equals_attnlab(dtype, activation, bias):
    model = make_model(dtype, activation, bias)
    module = to_torch(model)
    assert isinstance(module, torch.nn.Module)
    assert list(module.state_dict()) == list(model.state_dict())
    for name, t in module.state_dict().items():
        assert t.dtype == getattr(torch, dtype)
        np.testing.assert_array_equal(t.numpy(), model.state_dict()[name])
    ids = np.random.default_rng(3).integers(0, 11, size=(3, 8))
    with torch.no_grad():
        logits = module(torch.from_numpy(ids)).numpy()
    assert logits.dtype == np.dtype(dtype)
    assert rel_error(logits, model(ids)) <= TOL[dtype]


def test_tiny_transformer_round_trip_keeps_weights_mode_and_outputs():
    model = make_model(seed=4)
    model.eval()
    module = to_torch(model)
    assert not module.training
    module.train()
    back = from_torch(module, rng=np.random.default_rng(0))
    assert isinstance(back, TinyTransformer) and back.training
    assert back.config == model.config
    assert list(back.state_dict()) == list(model.state_dict())
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], w)
    ids = np.arange(6) % 11
    back.eval()
    np.testing.assert_array_equal(back(ids), model(ids))


def test_weights_trained_in_torch_come_back():
    """An SGD step in torch moves the weights; from_torch gives the model torch now holds."""
    model = make_model(seed=5)
    module = to_torch(model)
    ids = torch.from_numpy(np.random.default_rng(6).integers(0, 11, size=(2, 8)))
    module(ids).square().mean().backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.5 * p.grad
    module.eval()
    back = from_torch(module)
    back.eval()
    moved = [not np.array_equal(back.state_dict()[n], w) for n, w in model.state_dict().items()]
    assert all(moved)
    with torch.no_grad():
        want = module(ids).numpy()
    assert rel_error(back(ids.numpy()), want) <= TOL["float64"]


def test_from_torch_names_what_it_supports():
    with pytest.raises(TypeError, match=r"from_torch supports .*to_torch\(TinyTransformer\), transformers' "
                                        r"GPT2LMHeadModel or GPT2Model and transformers' BertModel, got Sequential"):
        from_torch(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"to_torch supports .*TinyTransformer, BertEncoder and GPT2, got GELU"):
        to_torch(GELU())


# --- BERT: attnlab's BertEncoder <-> transformers' BertModel --------------------------------

BERT = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
                  max_position_embeddings=20, layer_norm_eps=1e-7)


def make_bert(dtype="float32", seed=0):
    model = BertEncoder(BERT, rng=np.random.default_rng(seed), dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # move LayerNorm/bias off their ones/zeros
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return model


def bert_batch(seed=2):
    """ids, a padded attention mask (the second text has 3 padding tokens) and token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, BERT.vocab_size, size=(2, 9))
    mask = np.ones((2, 9), dtype=np.int64)
    mask[1, 6:] = 0
    return ids, mask, rng.integers(0, 2, size=(2, 9))


def hf_hidden_states(module, ids, mask, types) -> np.ndarray:
    with torch.no_grad():
        out = module(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     token_type_ids=torch.from_numpy(types), output_hidden_states=True)
    return np.stack([h.numpy() for h in out.hidden_states])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bert_to_torch_is_a_transformers_bert_model_with_equal_hidden_states(dtype):
    transformers = pytest.importorskip("transformers")
    model = make_bert(dtype)
    module = to_torch(model)
    assert type(module) is transformers.BertModel and not module.training
    hf = module.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "pad_token_id"):
        assert getattr(hf, field) == getattr(BERT, field), field
    names = bert_name_map(BERT.num_hidden_layers)
    state = module.state_dict()
    assert sorted(state) == sorted(src for sources in names.values() for src in sources)  # no pooler
    ours = model.state_dict()
    for name, sources in names.items():  # the fused query/key/value weights are split back
        np.testing.assert_array_equal(np.concatenate([state[s].numpy() for s in sources]), ours[name])
        assert all(state[s].dtype == getattr(torch, dtype) for s in sources)
    ids, mask, types = bert_batch()
    want = model(ids, mask, types).hidden_states  # (layers + 1, B, T, D), padded positions included
    got = hf_hidden_states(module, ids, mask, types)
    assert got.dtype == np.dtype(dtype)
    assert rel_error(got, want) <= TOL[dtype]


def test_bert_round_trip_and_weights_trained_in_torch_come_back():
    transformers = pytest.importorskip("transformers")
    model = make_bert("float64", seed=3)
    module = to_torch(model)
    back = from_torch(module)
    assert isinstance(back, BertEncoder) and back.config == model.config and back.dtype == np.float64
    assert list(back.state_dict()) == list(model.state_dict())
    for name, w in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], w)
    ids, mask, types = bert_batch(4)
    module.train()
    hidden = module(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    hidden.square().mean().backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.5 * p.grad
    module.eval()
    back = from_torch(module)
    moved = [not np.array_equal(back.state_dict()[n], w) for n, w in model.state_dict().items()]
    assert all(moved)
    assert rel_error(back(ids, mask, types).hidden_states, hf_hidden_states(module, ids, mask, types)) <= 1e-12
    # a model with a BERT inside gives its encoder back
    masked_lm = transformers.BertForMaskedLM(module.config).double()
    inner = from_torch(masked_lm)
    for name, w in inner.state_dict().items():
        np.testing.assert_array_equal(w, from_torch(masked_lm.bert).state_dict()[name])


def test_minilm_exports_to_a_bert_model_with_its_hidden_states():
    pytest.importorskip("transformers")
    if not minilm_available():
        pytest.skip("the MiniLM model (the pretrained extra) is not installed")
    model = shared_minilm()
    ids = np.array([[101, 1996, 2924, 1997, 1996, 2314, 1012, 102]])  # [CLS] the bank of the river . [SEP]
    mask, types = np.ones_like(ids), np.zeros_like(ids)
    got = hf_hidden_states(to_torch(model), ids, mask, types)
    assert rel_error(got, model(ids, mask, types).hidden_states) <= TOL["float32"]


# --- DistributedDataParallel: two processes on this machine -------------------------------

STEPS, BATCH, WORLD, LR = 2, 4, 2, 0.1


def batches():
    """One (ids, targets) batch per step; every token is a target, so equal halves of a batch
    average to the whole batch's mean loss."""
    rng = np.random.default_rng(7)
    return [(rng.integers(0, 11, size=(BATCH, 8)), rng.integers(0, 11, size=(BATCH, 8))) for _ in range(STEPS)]


def train(module, parameters, rank=0, world=1):
    """STEPS SGD steps on this rank's share of each batch; the gradients of every step."""
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    share = BATCH // world
    grads = []
    for ids, targets in batches():
        rows = slice(rank * share, (rank + 1) * share)
        logits = module(torch.from_numpy(ids[rows]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), torch.from_numpy(targets[rows]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        grads.append({name: p.grad.numpy().copy() for name, p in parameters()})
        opt.step()
    return grads


def ddp_worker(rank: int, init_method: str, out: str) -> None:
    """One DDP process: export the same attnlab model, train it on half of each batch."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool (as in DataLoader workers)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        module = to_torch(make_model(seed=8))
        ddp = DistributedDataParallel(module)
        grads = train(ddp, module.named_parameters, rank, WORLD)
        saved = {f"{step}/{k}": g for step, gs in enumerate(grads) for k, g in gs.items()}
        saved.update({f"final/{k}": w for k, w in from_torch(ddp).state_dict().items()})
        np.savez(f"{out}/rank{rank}.npz", **saved)
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_match_one_process(tmp_path, monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo talks over 127.0.0.1 only
    # The workers are spawned: a fork after the suite's thread pools (BLAS, attnlab's, torch's)
    # can hand a child a lock another thread held, and the child then waits forever.
    import torch._dynamo  # noqa: F401

    method = "spawn"  # not fork: a child forked after the suite's thread pools can inherit a held lock
    mp.start_processes(ddp_worker, args=(f"tcp://127.0.0.1:{port}", str(tmp_path)), nprocs=WORLD, start_method=method)

    module = to_torch(make_model(seed=8))
    want = train(module, module.named_parameters)
    final = from_torch(module).state_dict()
    for rank in range(WORLD):
        got = np.load(tmp_path / f"rank{rank}.npz")
        keys = [f"{step}/{k}" for step in range(STEPS) for k in want[step]] + [f"final/{k}" for k in final]
        assert sorted(got.files) == sorted(keys)
        for step in range(STEPS):
            for name, g in want[step].items():
                assert rel_error(got[f"{step}/{name}"], g) <= 1e-12, (rank, step, name)
        for name, w in final.items():  # the trained weights, back in attnlab
            assert rel_error(got[f"final/{name}"], w) <= 1e-12, (rank, name)


# ---- GPT-2: attnlab's GPT2 <-> transformers' GPT2LMHeadModel -------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpt2_to_torch_is_a_gpt2_lm_head_model_with_equal_logits(dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from attnlab.models import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=97, n_positions=16, n_embd=24, n_layer=2, n_head=3)
    model = GPT2(cfg, rng=np.random.default_rng(5), dtype=dtype)
    for p in model.parameters():  # non-zero biases and LayerNorm weights
        p.data += np.random.default_rng(6).standard_normal(p.shape).astype(dtype) * 0.1
    ids = np.random.default_rng(7).integers(0, 97, size=(2, 9))
    module = to_torch(model)
    assert isinstance(module, transformers.GPT2LMHeadModel)
    with torch.no_grad():
        theirs = module(torch.from_numpy(ids)).logits.numpy()
    assert theirs.dtype == dtype
    assert rel_error(model(ids), theirs) <= (1e-5 if dtype == np.float32 else 1e-12)
    back = from_torch(module)
    assert isinstance(back, GPT2) and back.config == cfg
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[name], value)
