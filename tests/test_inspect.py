"""attnlab.inspect against TransformerLens 4.3 (the oracle) on random-weight GPT-2 folders
written by transformers, the induction head of a trained recall model, and attention rollout
on MiniLM against the formula written out here.

TransformerLens runs as ORACLES.md says: ``TransformerBridge.boot_transformers(folder,
hf_model=...)`` then ``enable_compatibility_mode(no_processing=True)``, so its activations
are transformers' own (no folded or centred weights).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.inspect import (
    LogitAttribution,
    ablate_heads,
    activation_patching,
    attention_rollout,
    detect_heads,
    detection_pattern,
    direct_logit_attribution,
    logit_lens,
)
from attnlab.models import GPT2
from helpers import random_gpt2

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

# (n_layer, n_head, n_embd, vocab_size): one head, several heads, several blocks.
SHAPES = [(1, 1, 16, 30), (2, 4, 32, 50), (3, 2, 24, 40)]
TOL = 1e-5  # float32 against TransformerLens, absolute
MEASURED: dict[str, float] = {}  # worst error per check, printed with -s


@pytest.fixture(scope="module", autouse=True)
def _report_measured():
    """Prints the worst error of each comparison when the module ends (seen with -s)."""
    yield
    for what, err in sorted(MEASURED.items()):
        print(f"\n  {what}: max abs error {err:.3g}", end="")


def _record(what: str, err: float) -> float:
    MEASURED[what] = max(MEASURED.get(what, 0.0), err)
    return err


def _word_tokenizer(folder, vocab: int):
    """A word-level tokenizer: ``<s>`` (BOS) is id 0, ``w1 .. w{vocab-1}`` the others; saved
    in ``folder`` so TransformerLens can turn the detector's strings into our ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = {"<s>": 0} | {f"w{i}": i for i in range(1, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>", unk_token="<s>")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "L{}-H{}-D{}-V{}".format(*s))
def pair(request, tmp_path_factory):
    from transformer_lens.model_bridge import TransformerBridge

    n_layer, n_head, n_embd, vocab = request.param
    folder = tmp_path_factory.mktemp("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = random_gpt2(folder, seed=sum(request.param), n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                         vocab_size=vocab, n_positions=32)
        tokenizer = _word_tokenizer(folder, vocab)
        bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, load_weights=True,
                                                     tokenizer=tokenizer)
        bridge.enable_compatibility_mode(no_processing=True)
    return GPT2.from_pretrained(folder), bridge, folder


def _ids(vocab: int, shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


def _np(t) -> np.ndarray:
    return t.detach().numpy()


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------- logit lens


def test_logit_lens_matches_transformer_lens(pair):
    ours, bridge, _ = pair
    ids = _ids(ours.config.vocab_size, (2, 7), 1)
    logits, cache = ours.run_with_cache(ids)
    lens = logit_lens(ours, cache)
    with torch.no_grad():
        _, tc = bridge.run_with_cache(torch.from_numpy(ids))
        theirs = _np(bridge.unembed(tc.accumulated_resid(apply_ln=True)))
    N, V = ours.config.n_layer, ours.config.vocab_size
    assert lens.shape == theirs.shape == (N + 1, 2, 7, V) and lens.dtype == np.float32
    assert _record("logit_lens", _err(lens, theirs)) <= TOL
    np.testing.assert_allclose(lens[-1], logits, atol=TOL, rtol=0)  # the last entry is the model's logits


def test_logit_lens_reads_only_the_cache(pair):
    """Changing a cached residual changes that entry of the lens and no other."""
    ours, _, _ = pair
    _, cache = ours.run_with_cache(_ids(ours.config.vocab_size, (1, 5), 2))
    edited = dict(cache)
    edited["blocks.0.hook_resid_post"] = cache["blocks.0.hook_resid_post"][:, ::-1].copy()
    before, after = logit_lens(ours, cache), logit_lens(ours, edited)
    assert not np.allclose(before[1], after[1])
    np.testing.assert_array_equal(np.delete(before, 1, axis=0), np.delete(after, 1, axis=0))
    with pytest.raises(KeyError, match="blocks.0.hook_resid_pre"):
        logit_lens(ours, {k: v for k, v in cache.items() if k != "blocks.0.hook_resid_pre"})


# ----------------------------------------------------------------------------- direct logit attribution


def _their_dla(bridge, ids, tokens):
    """TransformerLens's decomposition at the final norm: ``apply_ln_to_stack`` (centred,
    divided by the real residual's cached scale) of the head results and of
    ``decompose_resid``, read along ``w_ln * W_U[:, token]``."""
    with torch.no_grad():
        _, tc = bridge.run_with_cache(torch.from_numpy(ids))
        heads = tc.apply_ln_to_stack(tc.stack_head_results(layer=-1), layer=-1)
        parts, labels = tc.decompose_resid(layer=-1, return_labels=True)
        parts = tc.apply_ln_to_stack(parts, layer=-1)
        u = bridge.W_U[:, torch.from_numpy(tokens)]  # (E, B, T)
        d = torch.einsum("ebt,e->bte", u, bridge.ln_final._original_component.weight)
        read = lambda stack: _np(torch.einsum("cbte,bte->cbt", stack, d))  # noqa: E731
        return read(heads), dict(zip(labels, read(parts), strict=True))


def test_direct_logit_attribution_matches_transformer_lens(pair):
    ours, bridge, _ = pair
    c = ours.config
    ids = _ids(c.vocab_size, (2, 6), 3)
    token = _ids(c.vocab_size, (2, 6), 4)
    logits, cache = ours.run_with_cache(ids)
    dla = direct_logit_attribution(ours, cache, token)
    assert isinstance(dla, LogitAttribution)
    N, H = c.n_layer, c.n_head
    assert dla.heads.shape == (N, H, 2, 6) and dla.mlp.shape == dla.attn_bias.shape == (N, 2, 6)
    assert dla.embed.shape == dla.pos_embed.shape == dla.bias.shape == (2, 6)
    heads, parts = _their_dla(bridge, ids, token)
    err = _err(dla.heads.reshape(N * H, 2, 6), heads)
    for i in range(N):
        err = max(err, _err(dla.mlp[i], parts[f"{i}_mlp_out"]))
        err = max(err, _err(dla.heads[i].sum(0) + dla.attn_bias[i], parts[f"{i}_attn_out"]))
    err = max(err, _err(dla.embed, parts["embed"]), _err(dla.pos_embed, parts["pos_embed"]))
    assert _record("direct_logit_attribution vs TL", err) <= TOL
    # The parts add up to the logit; without the norm's and the unembedding's bias they
    # add up to the logit minus exactly that.
    want = np.take_along_axis(logits, token[..., None], axis=-1)[..., 0]
    assert _record("direct_logit_attribution sum", _err(dla.total(), want)) <= TOL
    ln_b = ours.ln_f.bias.data.astype(np.float64)
    W_U = ours.tok_emb.weight.data.astype(np.float64)  # tied: (V, E)
    np.testing.assert_allclose(dla.bias, W_U[token] @ ln_b, atol=1e-9)
    stack, labels = dla.stack()
    assert stack.shape == (N * H + 2 * N + 3, 2, 6) and len(labels) == len(stack)
    assert labels[:3] == ["embed", "pos_embed", "L0H0"] and labels[-1] == "bias"
    np.testing.assert_allclose(stack.sum(0), dla.total(), atol=1e-9)


def test_direct_logit_attribution_is_transformer_lens_logit_attrs(pair):
    """With the final norm's weight folded into the unembedding (``fold_ln``, nothing
    centred), TransformerLens's own ``cache.logit_attrs`` is the same attribution, and its
    folded ``b_U`` is our ``bias``."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import GPT2LMHeadModel

    ours, _, folder = pair
    c = ours.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = GPT2LMHeadModel.from_pretrained(folder).eval()  # a fresh copy: folding rewrites its weights
        folded = TransformerBridge.boot_transformers(str(folder), hf_model=hf, load_weights=True)
        folded.enable_compatibility_mode(fold_ln=True, center_writing_weights=False, center_unembed=False,
                                         fold_value_biases=False)
    ids, token = _ids(c.vocab_size, (2, 6), 15), _ids(c.vocab_size, (2, 6), 16)
    _, cache = ours.run_with_cache(ids)
    dla = direct_logit_attribution(ours, cache, token)
    with torch.no_grad():
        _, tc = folded.run_with_cache(torch.from_numpy(ids))
        t = torch.from_numpy(token)
        heads = _np(tc.logit_attrs(tc.stack_head_results(layer=-1), t))
        parts, labels = tc.decompose_resid(layer=-1, return_labels=True)
        parts = dict(zip(labels, _np(tc.logit_attrs(parts, t)), strict=True))
        b_U = _np(folded.b_U)
    N, H = c.n_layer, c.n_head
    err = max(_err(dla.heads.reshape(N * H, 2, 6), heads), _err(dla.embed, parts["embed"]),
              _err(dla.pos_embed, parts["pos_embed"]), _err(dla.bias, b_U[token]))
    for i in range(N):
        err = max(err, _err(dla.mlp[i], parts[f"{i}_mlp_out"]),
                  _err(dla.heads[i].sum(0) + dla.attn_bias[i], parts[f"{i}_attn_out"]))
    assert _record("direct_logit_attribution vs TL logit_attrs (fold_ln)", err) <= TOL


def test_direct_logit_attribution_token_forms(pair):
    ours, _, _ = pair
    V = ours.config.vocab_size
    ids = _ids(V, (2, 5), 5)
    _, cache = ours.run_with_cache(ids)
    one = direct_logit_attribution(ours, cache, 3)
    per_seq = direct_logit_attribution(ours, cache, np.array([3, 3]))
    full = direct_logit_attribution(ours, cache, np.full((2, 5), 3))
    for other in (per_seq, full):
        np.testing.assert_array_equal(one.heads, other.heads)
        np.testing.assert_array_equal(one.bias, other.bias)
    with pytest.raises(ValueError, match=rf"token must lie in \[0, {V}\), got {V}"):
        direct_logit_attribution(ours, cache, V)
    with pytest.raises(ValueError, match=r"token has shape \(3,\)"):
        direct_logit_attribution(ours, cache, np.array([1, 2, 3]))
    with pytest.raises(KeyError, match="blocks.0.attn.hook_z"):
        direct_logit_attribution(ours, {k: v for k, v in cache.items() if "hook_z" not in k}, 3)


def test_one_unbatched_sequence_gives_the_batched_numbers(pair):
    ours, _, _ = pair
    V = ours.config.vocab_size
    ids = _ids(V, (6,), 14)
    _, one = ours.run_with_cache(ids)
    _, batch = ours.run_with_cache(ids[None])
    np.testing.assert_allclose(logit_lens(ours, one), logit_lens(ours, batch)[:, 0], atol=1e-6)
    a, b = direct_logit_attribution(ours, one, 2), direct_logit_attribution(ours, batch, 2)
    assert a.heads.shape == b.heads.shape[:2] + (6,)
    for x, y in zip(a.stack()[0], b.stack()[0], strict=True):
        np.testing.assert_allclose(x, y[0], atol=1e-6)
    metric = lambda logits: logits[..., -1, 1].sum()  # noqa: E731
    corrupted = (ids + 1) % V
    for hook in ("resid_pre", "z"):
        np.testing.assert_allclose(activation_patching(ours, ids, corrupted, metric, hook=hook),
                                   activation_patching(ours, ids[None], corrupted[None], metric, hook=hook),
                                   atol=1e-5)


# ----------------------------------------------------------------------------- ablation


def _their_ablation(bridge, ids, heads, fills=None):
    hooks = []
    for i in sorted({b for b, _ in heads}):
        hs = [h for b, h in heads if b == i]

        def hook(z, hook, hs=hs, i=i):
            z = z.clone()
            for h in hs:
                z[:, :, h, :] = 0 if fills is None else fills[i][h]
            return z

        hooks.append((f"blocks.{i}.attn.hook_z", hook))
    with torch.no_grad():
        return _np(bridge.run_with_hooks(torch.from_numpy(ids), fwd_hooks=hooks))


def test_zero_ablating_any_head_matches_transformer_lens(pair):
    ours, bridge, _ = pair
    c = ours.config
    ids = _ids(c.vocab_size, (2, 6), 6)
    clean = ours(ids)
    every = [(i, h) for i in range(c.n_layer) for h in range(c.n_head)]
    for heads in [[p] for p in every] + [every[::2], every]:
        got = ablate_heads(ours, ids, heads)
        assert _record("ablate_heads zero", _err(got, _their_ablation(bridge, ids, heads))) <= TOL
        assert not np.allclose(got, clean, atol=1e-4)  # the ablation did something
    np.testing.assert_allclose(ablate_heads(ours, ids, []), clean, atol=1e-6, rtol=0)


def test_mean_ablation_matches_transformer_lens(pair):
    ours, bridge, _ = pair
    c = ours.config
    ids = _ids(c.vocab_size, (3, 6), 7)
    heads = [(c.n_layer - 1, c.n_head - 1), (0, 0)]
    with torch.no_grad():
        _, tc = bridge.run_with_cache(torch.from_numpy(ids))
    fills = {i: tc[f"blocks.{i}.attn.hook_z"].mean(dim=(0, 1)) for i, _ in heads}
    got = ablate_heads(ours, ids, heads, how="mean")
    assert _record("ablate_heads mean", _err(got, _their_ablation(bridge, ids, heads, fills))) <= TOL
    assert not np.allclose(got, ablate_heads(ours, ids, heads), atol=1e-4)  # mean is not zero


def test_ablation_rejects_bad_heads(pair):
    ours, _, _ = pair
    c = ours.config
    ids = _ids(c.vocab_size, (1, 4), 8)
    with pytest.raises(ValueError, match=rf"head {c.n_head} is out of range for blocks with {c.n_head} heads"):
        ablate_heads(ours, ids, [(0, c.n_head)])
    with pytest.raises(ValueError, match=rf"block {c.n_layer} is out of range for a model with {c.n_layer}"):
        ablate_heads(ours, ids, [(c.n_layer, 0)])
    with pytest.raises(ValueError, match=r"heads\[0\] = \(-1, 0\): block -1"):
        ablate_heads(ours, ids, [(-1, 0)])
    with pytest.raises(TypeError, match=r"heads\[0\] must be a \(block, head\) pair of ints, got 0"):
        ablate_heads(ours, ids, [0])
    with pytest.raises(ValueError, match="how must be one of 'zero', 'mean', got 'max'"):
        ablate_heads(ours, ids, [(0, 0)], how="max")


# ----------------------------------------------------------------------------- patching

_HOOK = {"resid_pre": "blocks.{i}.hook_resid_pre", "attn_out": "blocks.{i}.hook_attn_out",
         "mlp_out": "blocks.{i}.hook_mlp_out", "z": "blocks.{i}.attn.hook_z"}


def _their_patching(bridge, clean, corrupted, metric, hook, count):
    """The same patching done by hand in TransformerLens: one run per (block, position or head)."""
    N = bridge.cfg.n_layers
    with torch.no_grad():
        _, tc = bridge.run_with_cache(torch.from_numpy(clean))
        out = np.empty((N, count))
        for i in range(N):
            name = _HOOK[hook].format(i=i)
            for k in range(count):
                def patch(a, hook, k=k, name=name):
                    a = a.clone()
                    if hook.name.endswith("hook_z"):
                        a[:, :, k] = tc[name][:, :, k]
                    else:
                        a[:, k] = tc[name][:, k]
                    return a

                logits = bridge.run_with_hooks(torch.from_numpy(corrupted), fwd_hooks=[(name, patch)])
                out[i, k] = metric(_np(logits))
    return out


@pytest.mark.parametrize("hook", ["resid_pre", "attn_out", "mlp_out", "z"])
def test_activation_patching_matches_transformer_lens(pair, hook):
    ours, bridge, _ = pair
    c = ours.config
    clean = _ids(c.vocab_size, (2, 6), 9)
    corrupted = clean.copy()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % c.vocab_size
    a, b = 3, 4

    def metric(logits):
        return float(np.mean(logits[:, -1, a] - logits[:, -1, b]))

    got = activation_patching(ours, clean, corrupted, metric, hook=hook)
    count = c.n_head if hook == "z" else 6
    assert got.shape == (c.n_layer, count) and got.dtype == np.float64
    theirs = _their_patching(bridge, clean, corrupted, metric, hook, count)
    assert _record(f"activation_patching {hook}", _err(got, theirs)) <= TOL
    # TransformerLens's own patching functions agree too.
    from transformer_lens import patching

    utility = {"resid_pre": patching.get_act_patch_resid_pre, "attn_out": patching.get_act_patch_attn_out,
               "mlp_out": patching.get_act_patch_mlp_out, "z": patching.get_act_patch_attn_head_out_all_pos}[hook]
    with torch.no_grad():
        _, tc = bridge.run_with_cache(torch.from_numpy(clean))
        theirs = _np(utility(bridge, torch.from_numpy(corrupted), tc, lambda logits: metric(_np(logits))))
    assert _record(f"activation_patching {hook} vs transformer_lens.patching", _err(got, theirs)) <= TOL
    if hook == "resid_pre":
        # Patching the changed position into block 0's input restores the clean run; the
        # positions before it change nothing.
        np.testing.assert_allclose(got[0, 2], metric(ours(clean)), atol=TOL)
        np.testing.assert_allclose(got[:, :2], metric(ours(corrupted)), atol=TOL)


def test_patching_rejects_bad_input(pair):
    ours, _, _ = pair
    V = ours.config.vocab_size
    clean, longer = _ids(V, (1, 5), 10), _ids(V, (1, 6), 11)
    metric = lambda logits: logits[0, -1, 0]  # noqa: E731
    with pytest.raises(ValueError, match=r"clean \(1, 5\) and corrupted \(1, 6\)"):
        activation_patching(ours, clean, longer, metric)
    with pytest.raises(ValueError, match="hook must be one of 'resid_pre', 'attn_out', 'mlp_out', 'z', 'pattern', "
                                         "'q', 'k', 'v', 'rot_q', 'rot_k', got 'mlp_mid'"):
        activation_patching(ours, clean, clean, metric, hook="mlp_mid")
    with pytest.raises(ValueError, match=r"hook 'rot_k': GPT2 has no hook point blocks.0.attn.hook_rot_k \(its "
                                         r"attention has no rotary positions\)"):
        activation_patching(ours, clean, clean, metric, hook="rot_k")
    with pytest.raises(ValueError, match="by_position=True splits a per-head kind by position too; "
                                         "hook='resid_pre' already has one cell per position"):
        activation_patching(ours, clean, clean, metric, by_position=True)
    with pytest.raises(TypeError, match=r"metric must return one number, got ndarray of shape \(1, 5\)"):
        activation_patching(ours, clean, clean, lambda logits: logits[..., 0])
    with pytest.raises(TypeError, match="metric must be a callable"):
        activation_patching(ours, clean, clean, 3)


# ----------------------------------------------------------------------------- head detectors


@pytest.mark.parametrize("kind", ["previous_token", "duplicate_token", "induction"])
@pytest.mark.parametrize("exclude", [(False, False), (True, True)], ids=["all", "exclude-bos-and-current"])
def test_detect_heads_equals_transformer_lens(pair, kind, exclude):
    from transformer_lens.head_detector import detect_head

    ours, bridge, _ = pair
    V = ours.config.vocab_size
    rng = np.random.default_rng(12)
    # Repeated halves, so every kind has something to find; TransformerLens prepends BOS (id 0).
    half = rng.integers(1, V, size=(3, 5))
    rows = np.concatenate([half, half], axis=1)
    texts = [" ".join(f"w{i}" for i in row) for row in rows]
    ids = np.concatenate([np.zeros((3, 1), dtype=rows.dtype), rows], axis=1)
    assert np.array_equal(_np(bridge.to_tokens(texts[0]))[0], ids[0])
    opts = dict(exclude_bos=exclude[0], exclude_current_token=exclude[1])
    got = detect_heads(ours, ids, kind, **opts)
    with torch.no_grad():
        theirs = _np(detect_head(bridge, texts, f"{kind}_head", **opts))
    assert got.shape == theirs.shape == (ours.config.n_layer, ours.config.n_head)
    assert _record("detect_heads", _err(got, theirs)) <= 1e-6
    one = detect_heads(ours, ids[0], kind, **opts)  # one unbatched sequence
    with torch.no_grad():
        assert _err(one, _np(detect_head(bridge, texts[0], f"{kind}_head", **opts))) <= 1e-6


def test_detection_patterns_follow_their_definitions():
    ids = np.array([7, 3, 7, 3, 9, 7])
    T = len(ids)
    prev, dup, ind = (detection_pattern(ids, k) for k in ("previous_token", "duplicate_token", "induction"))
    for i in range(T):
        for j in range(T):
            assert prev[i, j] == (j == i - 1)
            assert dup[i, j] == (j < i and ids[j] == ids[i])
            assert ind[i, j] == (1 <= j <= i and ids[j - 1] == ids[i] and j - 1 < i)
    with pytest.raises(ValueError, match="kind must be one of 'previous_token', 'duplicate_token', 'induction', "
                                         "got 'copy'"):
        detection_pattern(ids, "copy")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_detection_patterns_equal_transformer_lens(ids):
    from transformer_lens import head_detector

    ids = np.array(ids)
    tokens = torch.from_numpy(ids)[None]
    for kind in ("previous_token", "duplicate_token", "induction"):
        theirs = getattr(head_detector, f"get_{kind}_head_detection_pattern")(tokens)
        np.testing.assert_array_equal(detection_pattern(ids, kind), _np(theirs).astype(np.float64))


def test_detect_heads_rejects_an_unknown_kind(pair):
    ours, _, _ = pair
    with pytest.raises(ValueError, match="got 'induction_head'"):
        detect_heads(ours, np.array([[1, 2, 1, 2]]), "induction_head")


@pytest.fixture(scope="module")
def recall():
    """A 2-block TinyTransformer trained on associative recall until it answers (about 10 s)."""
    from attnlab.models.tiny import TinyTransformerConfig
    from attnlab.train.loop import TrainConfig, Trainer
    from attnlab.train.tasks import RecallTask

    task = RecallTask(num_keys=8, num_values=8, num_pairs=4, num_queries=4)
    trainer = Trainer.build(task, TinyTransformerConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64,
                                                        context_length=task.seq_len),
                            TrainConfig(steps=400, batch_size=32, lr=3e-3, warmup=20, eval_size=256))
    for _ in range(200):
        trainer.train_step()
    return trainer.model.eval(), task, trainer


def test_detect_heads_finds_the_induction_head_of_a_recall_model(recall):
    model, task, trainer = recall
    _, accuracy = trainer.evaluate()
    assert accuracy >= 0.95  # it has learnt to look up
    ids, _ = task.sample(64, rng=np.random.default_rng(13))
    scores = detect_heads(model, ids, "induction")
    # A query key's answer follows its earlier copy: block 1 must hold a head that attends there.
    best = np.unravel_index(np.argmax(scores), scores.shape)
    assert best[0] == 1, scores
    assert scores[best] >= 0.2 and scores[best] >= 2 * scores[0].max(), scores
    # On the query keys alone (the rows the task needs), that head's attention is induction.
    _, cache = model.run_with_cache(ids, names_filter="blocks.1.attn.hook_pattern")
    A = cache["blocks.1.attn.hook_pattern"][:, best[1]]  # (B, T, T)
    P = 2 * task.num_pairs
    at_queries = [A[b, q][detection_pattern(ids[b], "induction")[q] == 1].sum()
                  for b in range(len(ids)) for q in range(P, task.seq_len, 2)]
    assert np.mean(at_queries) >= 0.8, np.mean(at_queries)


# ----------------------------------------------------------------------------- attention rollout


def _rollout_by_the_paper(maps: np.ndarray) -> np.ndarray:
    """Abnar & Zuidema (2020), written out: per layer ``0.5 * mean_h A + 0.5 * I``, rows
    renormalised, multiplied from the first layer up; the rollout after each layer."""
    L, B, H, T, _ = maps.shape
    out = np.zeros((L, B, T, T))
    for b in range(B):
        acc = np.eye(T)
        for layer in range(L):
            A = 0.5 * maps[layer, b].astype(np.float64).mean(axis=0) + 0.5 * np.eye(T)
            A = A / A.sum(axis=1, keepdims=True)
            acc = A @ acc
            out[layer, b] = acc
    return out


@pytest.fixture(scope="module")
def minilm():
    from attnlab.models import load_minilm, minilm_available

    if not minilm_available():
        pytest.skip("the bundled MiniLM is not installed")
    return load_minilm()


def test_attention_rollout_on_minilm(minilm):
    enc = minilm.tokenizer.encode_batch(["the river bank was muddy after the rain", "money in the bank"])
    T = max(len(e.ids) for e in enc)
    ids = np.zeros((2, T), dtype=np.int64)
    mask = np.zeros((2, T), dtype=bool)
    for b, e in enumerate(enc):
        ids[b, : len(e.ids)], mask[b, : len(e.ids)] = e.ids, True
    out, cache = minilm.run_with_cache(ids, mask)
    rollout = attention_rollout(minilm, cache)
    N = len(minilm.layers)
    assert rollout.shape == (N, 2, T, T)
    # Against the formula applied to the maps the forward pass returns (not the cache).
    assert _record("attention_rollout", _err(rollout, _rollout_by_the_paper(out.attentions))) <= 1e-6
    np.testing.assert_allclose(rollout.sum(-1), 1, atol=1e-9)
    assert (rollout >= 0).all()
    # Padded keys get nothing: no real query draws on them.
    assert np.all(rollout[:, 1][:, mask[1]][:, :, ~mask[1]] == 0)


def test_attention_rollout_needs_the_maps(minilm):
    with pytest.raises(KeyError, match="blocks.0.attn.hook_pattern"):
        attention_rollout(minilm, {})
    with pytest.raises(TypeError, match="cache must be the mapping"):
        attention_rollout(minilm, [1, 2])


def test_the_vocabulary_readings_refuse_an_encoder(minilm):
    _, cache = minilm.run_with_cache(np.array([[101, 2003, 102]]))
    with pytest.raises(TypeError, match=r"BertEncoder has no final norm and unembedding \(ln_final, unembed\): "
                                        "the logit lens is defined for decoders"):
        logit_lens(minilm, cache)
    with pytest.raises(TypeError, match="the direct logit attribution is defined for decoders"):
        direct_logit_attribution(minilm, cache, 0)


def test_logit_lens_top_is_the_top_of_the_full_lens():
    from attnlab.core import softmax
    from attnlab.inspect import logit_lens, logit_lens_top
    from attnlab.models import GPT2, GPT2Config

    model = GPT2(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=3, n_head=2),
                 rng=np.random.default_rng(5))
    _, cache = model.run_with_cache(np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]))
    full = logit_lens(model, cache).astype(np.float64)
    ids, probs = logit_lens_top(model, cache, k=3)
    assert ids.shape == probs.shape == (4, 2, 5, 3)
    p = softmax(full, axis=-1)
    want = np.argsort(-full, axis=-1, kind="stable")[..., :3]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(probs, np.take_along_axis(p, want, axis=-1), rtol=1e-7, atol=1e-12)
    assert (np.diff(probs, axis=-1) <= 0).all()
    with pytest.raises(ValueError, match="k must be a positive int"):
        logit_lens_top(model, cache, k=0)
