"""Helpers shared by several test modules (import with ``from helpers import ...``): error
measures and kernel settings for attention tests, and tiny random models (BERT, GPT-2)
written as checkpoint folders."""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

import numpy as np
import pytest

from attnlab.core import blockwise
from attnlab.io import save_tensors
from attnlab.models.bert import BertConfig, expected_shapes


def rel_err(got: np.ndarray, want: np.ndarray, floor: float = 1e-30) -> float:
    """Largest absolute difference relative to the reference's largest entry (or ``floor``)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.size == 0:
        return 0.0
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(np.max(diff) / max(float(np.max(np.abs(want))), floor))


def grad_err(got: np.ndarray, want: np.ndarray) -> float:
    """:func:`rel_err` for gradients, relative to at least 1: the inputs are standard normal,
    so a gradient that is exactly 0 in theory (``L == S == 1``) is ``O(eps)`` in practice."""
    return rel_err(got, want, floor=1.0)


def attention_inputs(rng, batch, hq, h, L, S, E, Ev, dtype):
    """Standard normal ``q (*batch, hq, L, E)``, ``k``, ``v`` (``h`` heads) and ``grad_out``."""
    q = rng.standard_normal((*batch, hq, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, h, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, h, S, Ev)).astype(dtype)
    g = rng.standard_normal((*batch, hq, L, Ev)).astype(dtype)
    return q, k, v, g


# The two implementations of the blockwise kernel's element-wise pass: compiled (numba,
# the ``fast`` extra; installed for the test suite) and NumPy. Parametrize with this.
ELEMENTWISE_PASSES = [
    pytest.param(True, id="compiled", marks=pytest.mark.skipif(
        not blockwise.fused_available(), reason="numba (the fast extra) is not installed")),
    pytest.param(False, id="numpy"),
]


def kernel_tuning(fused: bool, **changes):
    """A ``blockwise.tuned`` context in which every call runs on the chosen element-wise
    pass and starts a real pool, however small the problem."""
    return blockwise.tuned(fused=fused, fused_min_scores=0, min_scores_per_thread=0, **changes)


# A BERT small enough to build in milliseconds, and a word-piece vocabulary that spells
# any lower-case ASCII text (letters, "##" letters, a few whole words, punctuation).
TINY_BERT = dict(vocab_size=80, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=16, max_position_embeddings=16)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [*string.ascii_lowercase, *("##" + c for c in string.ascii_lowercase),
         "the", "bank", "river", "money", "cat", "sat", "on", "mat", ".", ",", "!", "?"]


def pad_every_score_row(monkeypatch):
    """Every scores buffer gets padded rows (:func:`attnlab.core.blockwise.score_stride`,
    otherwise only for widths a multiple of 512), and every buffer is filled with NaN when
    it is handed out: a kernel that read a pad column, or any entry it had not written,
    would give NaN."""
    monkeypatch.setattr(blockwise, "_ALIASED_ROW_BYTES", 4)
    real = blockwise._buffer

    def poisoned(scratch, name, shape, dtype):
        buf = real(scratch, name, shape, dtype)
        buf.base.fill(np.nan)
        return buf

    monkeypatch.setattr(blockwise, "_buffer", poisoned)


def tiny_tokenizer(*, lowercase: bool = True, extra: int = 0):
    """A BERT word-piece ``tokenizers.Tokenizer`` over :data:`WORDS` (ids 0..68, plus
    ``extra`` more tokens)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = SPECIALS + WORDS + [f"extra{i}" for i in range(extra)]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return tok


def tiny_bert_weights(config: dict | None = None, *, seed: int = 0, prefix: str = "") -> dict:
    """Random ``transformers``-named tensors for a BERT of ``config`` (default :data:`TINY_BERT`)."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(BertConfig(**(config or TINY_BERT)))
    return {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_tiny_bert(folder: Path, *, config: dict | None = None, tensors: dict | None = None,
                    prefix: str = "") -> Path:
    """A random tiny BERT checkpoint folder: config.json, model.safetensors, tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(TINY_BERT, model_type="bert") if config is None else config))
    save_tensors(folder / "model.safetensors", tiny_bert_weights(prefix=prefix) if tensors is None else tensors)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


# ---- gradients: tolerances and measures shared by the backward tests
TOL = {np.float64: 1e-9, np.float32: 1e-4}


def grad_rel_err(got, want) -> float:
    """Largest difference relative to the largest reference entry; gradients that are zero
    in exact arithmetic (e.g. a key bias: softmax ignores shifts) compare absolutely."""
    dtype = np.asarray(got).dtype
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
    if os.environ.get("ATTNLAB_GRAD_REPORT"):  # collect the worst errors for the notes
        with open(os.environ["ATTNLAB_GRAD_REPORT"], "a") as f:
            f.write(f"{dtype} {err!r}\n")
    return err


def numerical_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``x`` (changed in place)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f()
        x[i] = old - h
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


# ---- softmax ------------------------------------------------------------------------


# ---- decoders: a byte-level BPE tokenizer and random GPT-2 folders written by transformers
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Text to train a small byte-level BPE tokenizer on (no tokenizer is downloaded).
CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "A transformer attends to every earlier token of the text it reads.",
    "Keys and values are cached, so each new token costs one step.",
    "Once upon a time there was a small model that learned to count: one, two, three.",
    "Café, naïve, Zürich: bytes make every word spellable.",
]


def byte_bpe_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """Train a GPT-2-style byte-level BPE tokenizer on :data:`CORPUS`; save it as ``path``
    (``tokenizer.json``) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path))
    return path


def random_gpt2(
    folder: Path,
    *,
    seed: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    vocab_size: int,
    n_positions: int = 64,
    scale: float = 1.0,
    **config,
):
    """A ``transformers`` ``GPT2LMHeadModel`` with every parameter random (biases and
    LayerNorm weights too, drawn after ``torch.manual_seed(seed)``), saved to ``folder``
    as safetensors; returns the torch model (eval mode, eager attention for the maps)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, bos_token_id=0, eos_token_id=0, **config)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(0.5 * scale * torch.randn_like(p))
            else:  # Conv1D (in, out)
                p.copy_(scale * torch.randn_like(p) / p.shape[0] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def random_llama(folder: Path, *, seed: int, vocab_size: int = 64, scale: float = 1.0, **shape):
    """A ``transformers`` ``LlamaForCausalLM`` with random weights (``torch.manual_seed(seed)``,
    transformers' initialisation, every matrix times ``scale``) saved to ``folder`` with a
    word-level tokenizer of ``t0`` .. ``t{V-1}`` (TransformerLens's bridge reads a tokenizer
    folder); returns the torch model (eval mode). ``shape``: LlamaConfig fields (hidden_size,
    num_attention_heads, ...)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, max_position_embeddings=64, bos_token_id=0,
                                   eos_token_id=1, **{"tie_word_embeddings": False, "pad_token_id": None, **shape})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if not name.endswith("norm.weight"):
                    p.mul_(scale)
    hf.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1",
                                         unk_token="t2").save_pretrained(folder)
    return hf


# ---- layers on other array libraries (Module.to) ----------------------------------------
# Each case: (build(dtype) -> layer, call(layer, to_library, dtype) -> output(s)). The inputs
# are made in NumPy and handed over through ``to_library`` (the identity for the NumPy path),
# so one case runs the same call in every library.


def perturbed(layer, seed: int = 1):
    """``layer`` with every parameter moved off its initial value (LayerNorm's ones, zero biases)."""
    rng = np.random.default_rng(seed)
    for p in layer.parameters():
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return layer


def normal(shape, dtype, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _keep(shape, seed: int = 3) -> np.ndarray:
    """A boolean mask (True = takes part) whose first key always takes part."""
    m = np.random.default_rng(seed).random(shape) < 0.6
    m[..., 0] = True
    return m


def _layer_cases():
    from attnlab.nn import GELU, Embedding, LayerNorm, Linear, MultiheadAttention, ReLU, SelfAttention, TransformerBlock

    def rng(seed=0):
        return np.random.default_rng(seed)

    def mha(**options):
        return lambda dt: MultiheadAttention(8, 2, rng=rng(), dtype=dt, **options)

    def block(**options):
        return lambda dt: TransformerBlock(8, 2, 12, rng=rng(), dtype=dt, **options)

    x = (2, 5, 8)  # (B, T, E)
    return {
        "Linear": (lambda dt: Linear(8, 5, rng=rng(), dtype=dt), lambda m, a, dt: m(a(normal(x, dt)))),
        "Linear-no-bias": (lambda dt: Linear(8, 5, False, rng=rng(), dtype=dt), lambda m, a, dt: m(a(normal(x, dt)))),
        "LayerNorm": (lambda dt: LayerNorm(8, dtype=dt), lambda m, a, dt: m(a(normal(x, dt) * 3 + 1))),
        "LayerNorm-no-affine": (
            lambda dt: LayerNorm(8, elementwise_affine=False, dtype=dt), lambda m, a, dt: m(a(normal(x, dt))),
        ),
        "GELU": (lambda dt: GELU(), lambda m, a, dt: m(a(normal((4, 300), dt) * 4))),
        "GELU-tanh": (lambda dt: GELU("tanh"), lambda m, a, dt: m(a(normal((4, 300), dt) * 4))),
        "ReLU": (lambda dt: ReLU(), lambda m, a, dt: m(a(normal(x, dt)))),
        "Embedding": (
            lambda dt: Embedding(11, 8, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(rng(4).integers(0, 11, size=(2, 5)))),
        ),
        "SelfAttention": (
            lambda dt: SelfAttention(8, 6, qkv_bias=True, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(normal(x, dt)), is_causal=True),
        ),
        "SelfAttention-cross-mask": (
            lambda dt: SelfAttention(8, 6, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(normal(x, dt)), a(normal((2, 7, 8), dt, 1)), attn_mask=a(_keep((5, 7)))),
        ),
        "MHA-self": (
            mha(batch_first=True),
            lambda m, a, dt: (lambda q: m(q, q, q))(a(normal(x, dt))),
        ),
        "MHA-cross-kdim-vdim-padding": (
            mha(kdim=6, vdim=4),  # (L, N, E) inputs
            lambda m, a, dt: m(a(normal((5, 2, 8), dt)), a(normal((7, 2, 6), dt, 1)), a(normal((7, 2, 4), dt, 2)),
                               key_padding_mask=a(_keep((2, 7)))),
        ),
        "MHA-cross-per-head-float-mask": (
            mha(batch_first=True),  # the fused in_proj_weight, applied in three parts
            lambda m, a, dt: m(a(normal(x, dt)), a(normal((2, 7, 8), dt, 1)), a(normal((2, 7, 8), dt, 2)),
                               attn_mask=a(normal((4, 5, 7), dt, 5)), average_attn_weights=False),
        ),
        "MHA-causal-padding-bias-kv-zero-attn": (
            mha(batch_first=True, add_bias_kv=True, add_zero_attn=True),
            lambda m, a, dt: (lambda q: m(q, q, q, key_padding_mask=a(_keep((2, 5))), is_causal=True))(
                a(normal(x, dt))),
        ),
        "MHA-unbatched-no-weights": (
            mha(),
            lambda m, a, dt: (lambda q: m(q, q, q, need_weights=False, is_causal=True))(a(normal((5, 8), dt))),
        ),
        "TransformerBlock-pre-norm-causal": (
            block(), lambda m, a, dt: m.forward_with_weights(a(normal(x, dt))),
        ),
        "TransformerBlock-post-norm-padding": (
            block(causal=False, norm_first=False, activation="relu"),
            lambda m, a, dt: m.forward_with_weights(a(normal(x, dt)), key_padding_mask=a(_keep((2, 5)))),
        ),
    }


LAYER_CASES = _layer_cases()


def run_case(name: str, dtype, to_library=None, *, convert=None):
    """Case ``name``'s outputs (a tuple, ``None`` entries kept): on NumPy, or after
    ``convert(layer)`` with inputs handed over by ``to_library``."""
    build, call = LAYER_CASES[name]
    layer = perturbed(build(np.dtype(dtype))).eval()
    if convert is not None:
        convert(layer)
    out = call(layer, to_library or (lambda arr: arr), dtype)
    return out if isinstance(out, tuple) else (out,)


# ---- the same intervention in attnlab and in TransformerLens (an oracle) -------------------


def assert_head_ablation_matches(model, bridge, ids: np.ndarray, layers, heads, atol: float = 1e-5) -> None:
    """Zero-ablating head ``h`` of block ``i`` (``hook_z``) gives the same logits in attnlab
    and in a TransformerLens bridge, for every ``i`` in ``layers`` and ``h`` in ``heads``."""
    import torch

    clean = model(ids)
    for layer in layers:
        name = f"blocks.{layer}.attn.hook_z"
        for head in heads:
            def ours(z, _name, h=head):
                z = z.copy()
                z[:, :, h] = 0
                return z

            def theirs(z, hook, h=head):
                z = z.clone()
                z[:, :, h] = 0
                return z

            a = model.run_with_hooks(ids, fwd_hooks=[(name, ours)])
            b = bridge.run_with_hooks(torch.tensor(ids), fwd_hooks=[(name, theirs)]).detach().numpy()
            np.testing.assert_allclose(a, b, atol=atol, err_msg=f"block {layer} head {head}")
            assert not np.allclose(a, clean, atol=1e-6)  # the ablation did something


def assert_resid_pre_patching_matches(model, bridge, clean: np.ndarray, corrupted: np.ndarray,
                                      atol: float = 1e-5) -> None:
    """Patching ``blocks.{i}.hook_resid_pre`` at each (block, position) from the clean run
    into the corrupted one gives the same logits in attnlab and in TransformerLens."""
    import torch

    _, ours_clean = model.run_with_cache(clean)
    _, tl_clean = bridge.run_with_cache(torch.tensor(clean))
    for layer in range(len(model.layers)):
        name = f"blocks.{layer}.hook_resid_pre"
        for pos in range(clean.shape[-1]):
            def ours(x, _name, p=pos, name=name):
                x = x.copy()
                x[:, p] = ours_clean[name][:, p]
                return x

            def theirs(x, hook, p=pos, name=name):
                x = x.clone()
                x[:, p] = tl_clean[name][:, p]
                return x

            a = model.run_with_hooks(corrupted, fwd_hooks=[(name, ours)])
            b = bridge.run_with_hooks(torch.tensor(corrupted), fwd_hooks=[(name, theirs)]).detach().numpy()
            np.testing.assert_allclose(a, b, atol=atol, err_msg=f"block {layer} position {pos}")


def random_examples(seed: int = 1, n: int = 7, vocab: int = 60):
    """Fine-tuning examples of random tokens and different lengths (4 to 11), each with a
    prompt (the first tokens, labelled -100) and an answer."""
    from attnlab.train.finetune import Example

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        T = int(rng.integers(4, 12))
        ids = rng.integers(3, vocab, T)
        labels = ids.copy()
        labels[: int(rng.integers(1, T - 1))] = -100
        out.append(Example(ids, labels))
    return out
