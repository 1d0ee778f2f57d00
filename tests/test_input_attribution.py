"""Input attribution against Captum 0.9 and torch autograd (oracles only), float64:
integrated gradients equal Captum's (IntegratedGradients on the token embeddings for a zero
baseline, LayerIntegratedGradients on the embedding layer for a token baseline) for every
integration rule; saliency and input x gradient equal torch autograd; BERT's pooled sentence
vector; generated sequences; the completeness gap; bad input."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
captum_attr = pytest.importorskip("captum.attr")

from attnlab.inspect import INTEGRATION_RULES, input_attribution, logit_diff  # noqa: E402
from attnlab.models import from_pretrained  # noqa: E402
from helpers import random_gpt2, random_llama  # noqa: E402
from hf_oracle import patch_eager  # noqa: E402

TARGET = 11


@pytest.fixture(autouse=True)
def exact_llama(monkeypatch):
    """transformers' Llama in float64 without its float32 RMSNorm and softmax (hf_oracle)."""
    patch_eager(monkeypatch).float64()


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        hf = random_gpt2(folder, seed=5, n_layer=2, n_head=4, n_embd=32, vocab_size=60)
    else:
        hf = random_llama(folder, seed=6, vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=3, scale=3.0)
    hf.config._attn_implementation = "eager"
    return from_pretrained(folder, dtype=np.float64), hf.double(), np.array([5, 9, 3, 17, 22, 8])


def _log_prob_of(hf, target=TARGET):
    def f(**inputs):
        logits = hf(**inputs).logits
        return torch.log_softmax(logits[:, -1], -1)[:, target]
    return f


@pytest.mark.parametrize("rule", INTEGRATION_RULES)
def test_integrated_gradients_equal_captum(pair, rule):
    """A zero baseline (GPT-2: position embeddings keep the residual off 0) against Captum's
    IntegratedGradients on the token embeddings; Llama's default, a token's embedding,
    against LayerIntegratedGradients on the embedding layer with that token's ids (the pad
    token's row is zero, as transformers initialises padding_idx: the end-of-sequence
    token's, id 1)."""
    ours, hf, ids = pair
    f = _log_prob_of(hf)
    x = torch.tensor(ids)[None]
    if ours.config.__class__.__name__ == "GPT2Config":
        emb = hf.get_input_embeddings()(x).detach()
        want = captum_attr.IntegratedGradients(lambda e: f(inputs_embeds=e)).attribute(
            emb, baselines=torch.zeros_like(emb), n_steps=20, method=rule)
        baseline = "zeros"
    else:
        lig = captum_attr.LayerIntegratedGradients(lambda i: f(input_ids=i), hf.get_input_embeddings())
        want = lig.attribute(x, baselines=torch.full_like(x, 1), n_steps=20, method=rule)
        baseline = None  # the default on a rotary model: a non-zero token embedding
    got = input_attribution(ours, ids, TARGET, steps=20, rule=rule, baseline=baseline, per_dim=True)
    want = want.detach().numpy()[0]
    assert got.per_dim.shape == want.shape
    assert np.abs(got.per_dim - want).max() <= 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(got.scores, want.sum(-1), atol=1e-4 * np.abs(want).max())
    # the completeness gap is what the rule leaves: Captum's trapezoid weights add to 1 - 1/n
    change = got.value - got.baseline_value
    assert got.gap == pytest.approx(got.scores.sum() - change)


def test_the_completeness_gap_at_50_steps_on_gpt2_with_a_zero_baseline(tmp_path):
    hf = random_gpt2(tmp_path, seed=8, n_layer=4, n_head=4, n_embd=64, vocab_size=100, scale=1.5)
    ours = from_pretrained(tmp_path, dtype=np.float64)
    ids = np.random.default_rng(0).integers(0, 100, size=12)
    target = int(np.argsort(hf(torch.tensor(ids)[None]).logits[0, -1].detach().numpy())[-2])
    got = input_attribution(ours, ids, target, steps=50, baseline="zeros")
    assert got.relative_gap <= 0.01


def test_saliency_and_input_x_gradient_equal_torch_autograd(pair):
    ours, hf, ids = pair
    emb = hf.get_input_embeddings()(torch.tensor(ids)[None]).detach().requires_grad_(True)
    _log_prob_of(hf)(inputs_embeds=emb).sum().backward()
    g, e = emb.grad.numpy()[0], emb.detach().numpy()[0]
    sal = input_attribution(ours, ids, TARGET, method="saliency", per_dim=True)
    np.testing.assert_allclose(sal.per_dim, g, atol=1e-6 * np.abs(g).max())
    np.testing.assert_allclose(sal.scores, np.linalg.norm(g, axis=-1), atol=1e-6 * np.abs(g).max())
    ixg = input_attribution(ours, ids, TARGET, method="input_x_gradient", per_dim=True)
    np.testing.assert_allclose(ixg.per_dim, g * e, atol=1e-6 * np.abs(g * e).max())
    np.testing.assert_allclose(ixg.scores, (g * e).sum(-1), atol=1e-6 * np.abs(g * e).max())
    assert sal.gap is None and sal.value == pytest.approx(_log_prob_of(hf)(input_ids=torch.tensor(ids)[None]).item())


@pytest.mark.parametrize("output", ["logit", "prob"])
def test_the_other_scalars(pair, output):
    ours, hf, ids = pair
    emb = hf.get_input_embeddings()(torch.tensor(ids)[None]).detach().requires_grad_(True)
    last = hf(inputs_embeds=emb).logits[0, -1]
    (last[TARGET] if output == "logit" else torch.softmax(last, -1)[TARGET]).backward()
    got = input_attribution(ours, ids, TARGET, method="saliency", per_dim=True, output=output)
    np.testing.assert_allclose(got.per_dim, emb.grad.numpy()[0], atol=1e-9)


def test_a_generated_sequence_has_one_row_per_token(pair):
    ours, _, ids = pair
    generated = [11, 4, 30]
    got = input_attribution(ours, ids, generated, method="input_x_gradient")
    assert got.scores.shape == (3, len(ids) + 2) and got.value.shape == (3,)
    for k, token in enumerate(generated):
        prefix = np.concatenate([ids, np.array(generated[:k], dtype=ids.dtype)])
        alone = input_attribution(ours, prefix, token, method="input_x_gradient")
        np.testing.assert_allclose(got.scores[k, :len(prefix)], alone.scores, atol=1e-10)
        assert not got.scores[k, len(prefix):].any()  # causal: nothing after what row k saw
    ig = input_attribution(ours, ids, generated, steps=8, batch_size=5)
    assert ig.gap.shape == (3,)


def test_a_left_padded_batch_gives_each_sequence_its_own_scores(pair):
    ours, _, ids = pair
    short = ids[2:]
    batch = np.stack([np.concatenate([[0, 0], short]), ids])
    mask = np.array([[0, 0] + [1] * len(short), [1] * len(ids)])
    got = input_attribution(ours, batch, [TARGET, 7], steps=10, attention_mask=mask)
    one = input_attribution(ours, short, TARGET, steps=10)
    two = input_attribution(ours, ids, 7, steps=10)
    np.testing.assert_allclose(got.scores[0, 2:], one.scores, atol=1e-8)
    np.testing.assert_allclose(got.scores[1], two.scores, atol=1e-8)


def test_a_metric_target(pair):
    ours, hf, ids = pair
    emb = hf.get_input_embeddings()(torch.tensor(ids)[None]).detach().requires_grad_(True)
    logits = hf(inputs_embeds=emb).logits
    (logits[0, -1, 11] - logits[0, -1, 12]).backward()
    got = input_attribution(ours, ids, logit_diff(11, 12), method="saliency", per_dim=True)
    np.testing.assert_allclose(got.per_dim, emb.grad.numpy()[0], atol=1e-9)


def test_bert_pooled_sentence_vector_equals_captum_and_autograd(tmp_path):
    from attnlab.models import BertEncoder
    from helpers import write_tiny_bert

    write_tiny_bert(tmp_path)
    ours = BertEncoder.from_pretrained(tmp_path, dtype=np.float64)
    hf = transformers.BertModel.from_pretrained(tmp_path, add_pooling_layer=False).double().eval()
    ids = np.array([2, 7, 9, 5, 11, 3])
    direction = np.random.default_rng(0).normal(size=ours.config.hidden_size)

    def cosine(**inputs):
        h = hf(**inputs).last_hidden_state.mean(1)  # mean pooling over the real tokens
        return torch.nn.functional.cosine_similarity(h, torch.tensor(direction)[None], dim=-1)

    emb = hf.get_input_embeddings()(torch.tensor(ids)[None]).detach().requires_grad_(True)
    cosine(inputs_embeds=emb).backward()
    sal = input_attribution(ours, ids, direction, method="saliency", per_dim=True)
    np.testing.assert_allclose(sal.per_dim, emb.grad.numpy()[0], atol=1e-6 * np.abs(emb.grad.numpy()).max())
    assert sal.output == "cosine"
    x = torch.tensor(ids)[None]
    lig = captum_attr.LayerIntegratedGradients(lambda i: cosine(input_ids=i), hf.get_input_embeddings())
    want = lig.attribute(x, baselines=torch.zeros_like(x), n_steps=20).detach().numpy()[0]
    got = input_attribution(ours, ids, direction, steps=20, baseline="pad", per_dim=True)
    assert np.abs(got.per_dim - want).max() <= 1e-4 * np.abs(want).max()


def test_input_attribution_rejects_bad_input(pair):
    ours, _, ids = pair
    V = ours.config.vocab_size
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        input_attribution(ours, ids, TARGET, steps=0)
    with pytest.raises(ValueError, match=rf"target {V} is outside the vocabulary \(0..{V - 1}\)"):
        input_attribution(ours, ids, V)
    with pytest.raises(ValueError, match="method must be one of 'saliency', 'input_x_gradient', "
                                         "'integrated_gradients'"):
        input_attribution(ours, ids, TARGET, method="deeplift")
    with pytest.raises(ValueError, match="baseline has shape"):
        input_attribution(ours, ids, TARGET, baseline=np.zeros(3))
    with pytest.raises(ValueError, match="the trapezoid rule needs steps >= 2"):
        input_attribution(ours, ids, TARGET, steps=1, rule="riemann_trapezoid")
    with pytest.raises(TypeError, match="target must be a token id"):
        input_attribution(ours, ids, "Paris")
    with pytest.raises(TypeError, match="input_attribution needs a metric with a gradient.*got function without "
                                        r"\.grad"):
        input_attribution(ours, ids, lambda logits: float(logits[..., -1, TARGET].sum()))
    if ours.config.__class__.__name__ != "GPT2Config":
        with pytest.warns(RuntimeWarning, match="a zero baseline on a model without position embeddings"):
            input_attribution(ours, ids, TARGET, steps=2, baseline="zeros")
        with pytest.warns(RuntimeWarning, match=r"the pad token's embedding \(id 3\) is zero"):
            input_attribution(ours, ids, TARGET, steps=2, baseline="pad")


def test_quantized_weights_say_to_load_dequantized():
    from attnlab.models import Llama, LlamaConfig
    from attnlab.quant import QuantizedTensor

    llama = Llama(LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2), rng=np.random.default_rng(0))
    up = llama.layers[0].mlp.up_proj.weight
    up.data = QuantizedTensor.quantize(up.data, "Q8_0")
    with pytest.raises(TypeError, match=r"input_attribution needs gradients, .* is kept quantized \(Q8_0\).*load the "
                                        "model dequantized"):
        input_attribution(llama, np.array([1, 2, 3]), 4)
