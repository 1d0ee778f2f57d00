"""Explanations for the report tests and benchmark (random arrays, a traced attention call)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnlab.core import softmax
from attnlab.explain import Explanation

XSS_IMG = "<img src=x onerror=alert(1)>"
XSS_SCRIPT = "</script><script>alert(1)</script>"


def random_explanation(
    T: int, layers: int, heads: int, *, tokens: list[str] | None = None, text: str | None = None,
    dim: int = 32, seed: int = 0, sharpness: float = 3.0, model: str = "random test model",
) -> Explanation:
    """Random attention maps (softmax of Gaussian logits) and random vectors."""
    rng = np.random.default_rng(seed)
    tokens = list(tokens) if tokens is not None else [f"tok{i}" for i in range(T)]
    T = len(tokens)
    logits = rng.standard_normal((layers, heads, T, T)) * sharpness  # (layers, H, L, S)
    att = softmax(logits, axis=-1)
    static = rng.standard_normal((T, dim))
    contextual = static + 0.5 * rng.standard_normal((T, dim))
    return Explanation(
        text=text if text is not None else " ".join(tokens),
        tokens=tokens,
        model=model,
        attentions=att,
        static=static,
        contextual=contextual,
        notes=["random numbers for a test"],
    )


@dataclass
class Step:
    """A trace record as attnlab.trace writes it (attributes, not a dict)."""

    name: str
    values: np.ndarray
    head: int | None
    description: str = ""


@dataclass
class Trace:
    steps: list[Step]


def traced_explanation(*, heads: int = 1, causal: bool = False, seed: int = 0) -> Explanation:
    """A worked attention call: 3 words with 4-dim embeddings, d_k = 3 per head.

    The trace is an object with ``steps`` records (name, values, head, description), in the
    order of attnlab.trace; with ``causal`` it holds ``masked_scores`` with -inf.
    """
    rng = np.random.default_rng(seed)
    tokens = ["I", "love", "attention"]
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float64)  # (T, E)
    d_k = 3
    steps = [Step("X", x, None, "input token vectors")]
    wq, wk, wv = (rng.standard_normal((heads, 4, d_k)) for _ in range(3))  # (H, E, D)
    for name, w in (("W_q", wq), ("W_k", wk), ("W_v", wv)):
        steps += [Step(name, w[h], h, f"{name} of head {h}") for h in range(heads)]
    q, k, v = (np.einsum("te,hed->htd", x, w) for w in (wq, wk, wv))  # (H, T, D)
    scores = np.einsum("hld,hsd->hls", q, k)
    scaled = scores / np.sqrt(d_k)
    masked = np.where(np.tril(np.ones((3, 3), bool)), scaled, -np.inf) if causal else None
    weights = softmax(masked if causal else scaled, axis=-1)
    out = np.einsum("hls,hsd->hld", weights, v)
    for name, arr in (("Q", q), ("K", k), ("V", v), ("scores", scores), ("scaled_scores", scaled),
                      ("masked_scores", masked), ("weights", weights)):
        if arr is not None:
            steps += [Step(name, arr[h], h, f"{name} of head {h}") for h in range(heads)]
    if heads == 1:
        steps.append(Step("output", out[0], None, "weights V"))
        contextual = out[0]
    else:
        steps += [Step("head_output", out[h], h, "weights V") for h in range(heads)]
        concat = out.transpose(1, 0, 2).reshape(3, heads * d_k)  # (H, T, D) -> (T, H*D)
        w_o = rng.standard_normal((heads * d_k, heads * d_k))
        steps += [Step("concat", concat, None), Step("W_o", w_o, None)]
        contextual = concat @ w_o
        steps.append(Step("output", contextual, None, "concat W_o"))
    return Explanation(
        text="I love attention",
        tokens=tokens,
        model=f"worked example: 1 layer, {heads} head(s), d_k = 3",
        attentions=weights[None],  # (1, H, T, T)
        static=x,
        contextual=contextual,
        trace=Trace(steps),
    )


def inside_explanation(
    T: int, layers: int, heads: int, *, seed: int = 0, k: int = 3, patching: bool = True, causal: bool = True,
    dim: int = 16, vocab: int = 50,
) -> Explanation:
    """A decoder-like explanation with what explain reads from inside: a logit lens (random
    ids with probabilities, every third cell's top token the next token of the text), head
    detector scores in [0, 1] and a patching result (blocks x tokens); causal maps."""
    from attnlab.explain import Lens, Patching

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, T)
    tokens = [f"w{i}" for i in ids]
    e = random_explanation(0, layers, heads, tokens=tokens, dim=dim, seed=seed, model="decoder test model")
    if causal:
        logits = rng.standard_normal((layers, heads, T, T)) * 3
        logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
        e.attentions = softmax(logits, axis=-1)
    top = rng.integers(0, vocab, (layers + 1, T, k))
    right = np.zeros((layers + 1, T), bool)
    right[:, :-1] = (np.arange(T - 1) % 3 == 0)[None]
    top[..., 0] = np.where(right, np.append(ids[1:], 0)[None], top[..., 0])
    probs = np.sort(rng.dirichlet(np.ones(k + 1), (layers + 1, T))[..., :k], axis=-1)[..., ::-1]
    e.lens = Lens(top, probs, {i: f"w{i}" for i in range(vocab)})
    e.head_scores = {kind: rng.uniform(0, 1, (layers, heads))
                     for kind in ("previous_token", "duplicate_token", "induction")}
    if patching:
        bad = list(tokens)
        bad[1] = "CHANGED"
        e.patching = Patching(rng.uniform(-1, 3, (layers, T)), "corrupted text", bad, 3, "w3", 4, "w4", 2.5, -0.5)
    return e
