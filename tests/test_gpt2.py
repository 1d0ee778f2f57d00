"""GPT-2 built from attnlab's blocks against ``transformers``' ``GPT2LMHeadModel``.

Random-weight models of several shapes are written by transformers
(``save_pretrained(safe_serialization=True)``, every parameter random, biases and LayerNorm
weights included) and loaded by :meth:`attnlab.models.GPT2.from_pretrained`. Targets:
logits, hidden states and attention maps layer by layer within 1e-4 (fp32); greedy
generation token for token equal to ``generate(do_sample=False)``, single and batched
left-padded; cached logits equal to the full pass within 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from attnlab.io import CheckpointError, load_tensors, save_tensors
from attnlab.models import GPT2, GPT2Config
from helpers import byte_bpe_tokenizer, random_gpt2

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# (n_layer, n_head, n_embd, vocab_size): every head count and width of the targets, and the
# full GPT-2 vocabulary with a tiny width.
SHAPES = [(1, 1, 32, 100), (2, 4, 64, 1000), (3, 8, 128, 317), (4, 8, 256, 5000), (2, 2, 32, 50257)]
TOL = 1e-4


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "L{}-H{}-D{}-V{}".format(*s))
def pair(request, tmp_path_factory):
    n_layer, n_head, n_embd, vocab = request.param
    folder = tmp_path_factory.mktemp("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = random_gpt2(folder, seed=sum(request.param), n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                             vocab_size=vocab)
    return GPT2.from_pretrained(folder), theirs, folder


def _ids(vocab: int, shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def _left_padded(vocab: int, lengths, seed: int):
    T = max(lengths)
    ids = _ids(vocab, (len(lengths), T), seed)
    mask = np.arange(T)[None, :] >= T - np.array(lengths)[:, None]
    ids[~mask] = 0  # what the padding holds must not matter
    return ids, mask


def test_logits_hidden_states_and_maps_match_transformers(pair):
    ours, theirs, _ = pair
    c = ours.config
    ids = _ids(c.vocab_size, (2, 23), 1)
    with torch.no_grad():
        ref = theirs(torch.from_numpy(ids), output_hidden_states=True, output_attentions=True)
    out = ours.inspect(ids)
    assert np.abs(ours(ids) - ref.logits.numpy()).max() < TOL
    assert np.abs(out.logits - ref.logits.numpy()).max() < TOL
    assert len(ref.hidden_states) == c.n_layer + 1 == len(out.hidden_states)
    for k in range(c.n_layer + 1):
        # transformers' last hidden state is after the final LayerNorm; attnlab's layer k is
        # the output of block k
        h = ours.ln_f(out.hidden_states[k]) if k == c.n_layer else out.hidden_states[k]
        assert np.abs(h - ref.hidden_states[k].numpy()).max() < TOL, k
    for k in range(c.n_layer):
        assert np.abs(out.attentions[k] - ref.attentions[k].numpy()).max() < TOL, k
    assert np.all(np.triu(out.attentions, k=1) == 0)  # causal: no token sees a later one


def test_left_padded_forward_matches_transformers_at_real_tokens(pair):
    ours, theirs, _ = pair
    ids, mask = _left_padded(ours.config.vocab_size, [9, 4, 1], 2)
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)  # transformers' generate positions
    with torch.no_grad():
        ref = theirs(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                     position_ids=torch.from_numpy(pos)).logits.numpy()
    logits = ours(ids, attention_mask=mask)
    assert np.abs(logits[mask] - ref[mask]).max() < TOL
    # a real token's logits do not depend on the padding before it
    alone = ours(ids[1:2, -4:])
    assert np.abs(logits[1, -4:] - alone[0]).max() < TOL


def _hf_generate(theirs, ids, n, mask=None, eos=None):
    theirs.generation_config.eos_token_id = eos
    theirs.generation_config.pad_token_id = eos
    kw = {} if mask is None else {"attention_mask": torch.from_numpy(mask.astype(np.int64))}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return theirs.generate(torch.from_numpy(ids), max_new_tokens=n, do_sample=False, **kw).numpy()


def test_greedy_generation_equals_transformers_token_for_token(pair):
    ours, theirs, _ = pair
    V = ours.config.vocab_size
    single = _ids(V, (1, 7), 3)
    assert np.array_equal(ours.generate(single, 20), _hf_generate(theirs, single, 20))
    ids, mask = _left_padded(V, [6, 2, 11], 4)
    got = ours.generate(ids, 15, attention_mask=mask)
    assert got.shape == (3, 26)
    assert np.array_equal(got, _hf_generate(theirs, ids, 15, mask))
    # each padded prompt continues as it does alone
    for row, n in zip(range(3), [6, 2, 11], strict=True):
        assert np.array_equal(got[row, 11 - n :], ours.generate(ids[row, 11 - n :], 15))


def test_generation_stops_at_eos_like_transformers(pair):
    ours, theirs, _ = pair
    ids, mask = _left_padded(ours.config.vocab_size, [5, 8], 5)
    free = ours.generate(ids, 12, attention_mask=mask)
    eos = int(free[0, 8 + 3])  # row 0's fourth new token
    got = ours.generate(ids, 12, attention_mask=mask, eos_token_id=eos)
    assert np.array_equal(got, _hf_generate(theirs, ids, 12, mask, eos))
    assert (got[0, 8 + 3 :] == eos).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cached_logits_equal_the_full_pass(pair, dtype):
    """float32: within 1e-5 of the logits' scale (the suite's float32 parity measure);
    float64: within 1e-10 absolute, so the cache itself loses nothing."""
    if dtype == "float64" and pair[0].config.n_embd > 128:
        pytest.skip("float64 runs on the smaller shapes (test time)")
    ours = pair[0] if dtype == "float32" else GPT2.from_pretrained(pair[2], dtype=np.float64)
    tol = 1e-10 if dtype == "float64" else 1e-5

    def error(a, b):
        err = float(np.abs(a - b).max())
        return err if dtype == "float64" else err / float(np.abs(b).max())

    ids, mask = _left_padded(ours.config.vocab_size, [30, 17], 6)
    full = ours(ids, attention_mask=mask)
    cache = ours.new_cache()
    parts, t = [], 0
    for n in (12, 1, 5, 1, 1, 10):
        parts.append(ours(ids[:, t : t + n], attention_mask=mask[:, : t + n], cache=cache))
        t += n
    cached = np.concatenate(parts, axis=1)
    assert [len(c) for c in cache] == [30] * ours.config.n_layer
    assert error(cached[mask], full[mask]) < tol
    # no padding: the mask-free path, one token at a time
    ids = ids[:1]
    cache = ours.new_cache()
    steps = [ours(ids[:, i : i + 1], cache=cache) for i in range(ids.shape[1])]
    assert error(np.concatenate(steps, axis=1), ours(ids)) < tol


@pytest.mark.parametrize("pair", [SHAPES[1]], indirect=True, ids=["L2-H4-D64-V1000"])
def test_sampling_is_reproducible_and_respects_top_k(pair):
    ours, _, _ = pair
    ids = _ids(ours.config.vocab_size, (2, 5), 7)
    a = ours.generate(ids, 10, temperature=0.8, top_k=3, rng=np.random.default_rng(1))
    b = ours.generate(ids, 10, temperature=0.8, top_k=3, rng=np.random.default_rng(1))
    assert np.array_equal(a, b)
    assert np.array_equal(a[:, :5], ids)
    # every sampled token is among the 3 likeliest after its prefix
    for row in a:
        logits = ours(row[None, :-1])[0, 4:]
        top3 = np.argsort(logits, axis=-1)[:, -3:]
        assert all(t in top for t, top in zip(row[5:], top3, strict=True))


def test_trace_records_the_blocks_maps(pair):
    ours, _, _ = pair
    ids = _ids(ours.config.vocab_size, (9,), 8)
    maps = ours.inspect(ids[None]).attentions[:, 0]
    for layer in (1, -1):
        t = ours.trace(ids, layer=layer)
        k = layer % (ours.config.n_layer + 1) if layer < 0 else layer
        k = ours.config.n_layer if layer == -1 else k
        assert t.layer == k
        for h in range(ours.config.n_head):
            assert np.array_equal(t.get("weights", h), maps[k - 1, h])


@pytest.mark.parametrize("activation, n_inner", [("relu", 48), ("gelu", None), ("gelu_pytorch_tanh", 80)])
def test_other_activations_and_widths(tmp_path, activation, n_inner):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = random_gpt2(tmp_path, seed=9, n_layer=1, n_head=2, n_embd=32, vocab_size=64,
                             activation_function=activation, n_inner=n_inner)
    ours = GPT2.from_pretrained(tmp_path)
    ids = _ids(64, (2, 10), 9)
    with torch.no_grad():
        ref = theirs(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours(ids) - ref).max() < TOL


@pytest.mark.parametrize("pair", [SHAPES[0]], indirect=True, ids=["L1-H1-D32-V100"])
def test_files_without_the_transformer_prefix(pair, tmp_path):
    """``GPT2Model`` files (and the original GPT-2 uploads) name tensors without the
    ``transformer.`` prefix and may hold the old causal-mask buffers (ignored)."""
    ours, _, folder = pair

    def rename(t):
        out = {k.removeprefix("transformer."): v for k, v in t.items()}
        out["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.uint8))
        return out

    plain = _copy(folder, tmp_path / "plain", tensors=rename)
    ids = _ids(ours.config.vocab_size, (1, 12), 10)
    assert np.array_equal(GPT2.from_pretrained(plain)(ids), ours(ids))
    # a weights dict in transformers' names works as the file does
    weights = load_tensors(folder / "model.safetensors")
    assert np.array_equal(GPT2(ours.config, weights)(ids), ours(ids))


# ----------------------------------------------------------------------------- text


@pytest.fixture(scope="module")
def text_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2-text")
    byte_bpe_tokenizer(folder / "tokenizer.json")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = random_gpt2(folder, seed=11, n_layer=2, n_head=4, n_embd=64, vocab_size=vocab)
    return GPT2.from_pretrained(folder), theirs, folder


def test_text_in_text_out_matches_transformers(text_pair):
    ours, theirs, folder = text_pair
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>",
                                  padding_side="left")
    prompts = ["The cat sat", "Keys and values are cached, so"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = theirs.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    keep = np.concatenate([batch["attention_mask"].numpy().astype(bool), np.ones((2, 12), bool)], axis=1)
    expected = [tok.decode(r[k], skip_special_tokens=True) for r, k in zip(ref.numpy(), keep, strict=True)]
    assert ours.generate_text(prompts, 12) == expected
    assert ours.generate_text(prompts[0], 12) == expected[0]
    ids, tokens = ours.encode("The cat sat")
    assert tokens == tok.convert_ids_to_tokens(ids.tolist())
    t = ours.trace("The cat sat", layer=2, head=1)
    # the trace's labels are the tokens as text ('Ġcat' reads '␣cat'); encode keeps them raw
    assert t.tokens == [x.replace("Ġ", "\u2423") for x in tokens] and t.get("weights", 1).shape == (len(ids), len(ids))


def test_generate_text_cuts_at_eos(text_pair):
    ours, _, _ = text_pair
    prompt = ours.encode("The dog")[0]
    free = ours.generate(prompt, 8)
    eos = int(free[-5])
    first = len(prompt) + free[len(prompt) :].tolist().index(eos)
    text = ours.generate_text("The dog", 8, eos_token_id=eos)
    assert text == ours.tokenizer.decode(free[:first].tolist())


def test_no_torch_at_run_time(text_pair):
    _, _, folder = text_pair
    code = (
        "import sys, numpy as np\n"
        "from attnlab.models import GPT2\n"
        f"m = GPT2.from_pretrained({str(folder)!r})\n"
        "print(m.generate_text('The cat', 3))\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2-small")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_gpt2(folder, seed=3, n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=20)
    return folder


def _copy(folder: Path, dest: Path, *, config=None, tensors=None) -> Path:
    dest.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config or {})
    (dest / "config.json").write_text(json.dumps(cfg))
    t = load_tensors(folder / "model.safetensors")
    save_tensors(dest / "model.safetensors", tensors(t) if tensors else t)
    return dest


def test_n_embd_not_divisible_by_n_head(small, tmp_path):
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        GPT2Config(n_embd=30, n_head=4)
    bad = _copy(small, tmp_path / "bad", config={"n_head": 3})
    with pytest.raises(CheckpointError, match=r"config.json: n_embd=32 must be divisible by n_head=3"):
        GPT2.from_pretrained(bad)


def test_token_ids_outside_the_vocabulary(small):
    model = GPT2.from_pretrained(small)
    with pytest.raises(ValueError, match=r"input_ids holds token id 100, but token ids must lie in \[0, 100\)"):
        model(np.array([[1, 100]]))
    with pytest.raises(ValueError, match="token id -1"):
        model.generate(np.array([[-1, 3]]), 2)
    with pytest.raises(TypeError, match="integer token ids"):
        model(np.array([[1.0, 2.0]]))


def test_prompt_plus_new_tokens_beyond_n_positions(small):
    model = GPT2.from_pretrained(small)
    with pytest.raises(ValueError, match=r"the prompt has 15 tokens and max_new_tokens=6: 21 positions, "
                                         r"but the model has n_positions=20"):
        model.generate(np.zeros((1, 15), np.int64), 6)
    assert model.generate(np.zeros((1, 15), np.int64), 5).shape == (1, 20)
    with pytest.raises(ValueError, match=r"n_positions=20"):
        model(np.zeros((1, 21), np.int64))


def test_missing_or_misshapen_tensors(small, tmp_path):
    missing = _copy(small, tmp_path / "missing",
                    tensors=lambda t: {k: v for k, v in t.items() if k != "transformer.h.1.mlp.c_fc.bias"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) h.1.mlp.c_fc.bias"):
        GPT2.from_pretrained(missing)
    # a torch Linear layout (out, in) where the checkpoint needs Conv1D's (in, out)
    flipped = _copy(small, tmp_path / "flipped", tensors=lambda t: {
        k: (v.T.copy() if k.endswith("h.0.attn.c_attn.weight") else v) for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"tensor 'h.0.attn.c_attn.weight' has shape \(96, 32\), "
                                              r"but should be \(32, 96\)"):
        GPT2.from_pretrained(flipped)
    wide = _copy(small, tmp_path / "wide", config={"vocab_size": 101})
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(100, 32\), but should be \(101, 32\)"):
        GPT2.from_pretrained(wide)
    fewer = _copy(small, tmp_path / "fewer", config={"n_layer": 1})
    with pytest.raises(CheckpointError, match="n_layer is 1, but .* holds 2 layers"):
        GPT2.from_pretrained(fewer)
    with pytest.raises(CheckpointError, match="model_type is 'bert'"):
        GPT2.from_pretrained(_copy(small, tmp_path / "bert", config={"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx=True is not supported"):
        GPT2.from_pretrained(_copy(small, tmp_path / "scaled", config={"scale_attn_by_inverse_layer_idx": True}))


def test_pickle_only_checkpoint_is_never_loaded(small, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((small / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")  # would fail to unpickle
    with pytest.raises(CheckpointError, match="only pytorch_model.bin .*never loaded.*convert it to model.safetensors"):
        GPT2.from_pretrained(folder)
    with pytest.raises(FileNotFoundError):
        GPT2.from_pretrained(tmp_path / "nowhere")


def test_bad_generation_options(small):
    model = GPT2.from_pretrained(small)
    ids = np.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(ids, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k=5 needs sampling"):
        model.generate(ids, 2, top_k=5)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        model.generate(ids, -1)
    with pytest.raises(ValueError, match="row 0 is not left-padded"):
        model.generate(ids, 2, attention_mask=np.array([[1, 1, 0]]))
    with pytest.raises(ValueError, match="row 0 has no real token"):
        model.generate(ids, 2, attention_mask=np.array([[0, 0, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\)"):
        model.generate(ids, 2, attention_mask=np.array([[1, 1]]))
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate_text("hello", 2)
    assert np.array_equal(model.generate(ids, 0), ids)
