"""The models ``explain`` can run, as plain callables.

Each takes ``(text, *, layer=None, head=None, trace=None, **its own options)`` and returns
an :class:`~attnlab.explain.Explanation`. Heavy imports (the pretrained model, tokenizers,
checkpoints) happen inside the callable that needs them, so ``import attnlab.explain`` is
cheap and a missing extra only matters to the model that needs it (``ImportError``).

``layer`` and ``head`` say which map to open on; ``layer`` follows attnlab's numbering
(``1..n`` = output of block ``k``, negatives from the end; 0, the embeddings, has no
attention and is refused). The step-by-step trace is recorded for that layer by the
model's own layers (:func:`attnlab.trace`), so its weights are the maps shown.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnlab._validation import layer_number, positive_int

if TYPE_CHECKING:
    from attnlab.explain import Explanation

#: With ``trace=None`` the trace is recorded for texts of at most this many tokens (a trace
#: keeps several ``(T, T)`` arrays per head).
TRACE_MAX_TOKENS = 256


def _place(layer, head, n_layers: int, n_heads: int) -> tuple[int, int]:
    """``(layer 1..n, head 0..H-1)`` from the caller's choice (defaults: last layer, head 0)."""
    from attnlab.explain import _head_index

    k = n_layers if layer is None else layer_number(layer, n_layers, embeddings=False)
    return k, _head_index(0 if head is None else head, n_heads)


def _want_trace(trace: bool | None, T: int) -> bool:
    return T <= TRACE_MAX_TOKENS if trace is None else bool(trace)


def _trace_note(trace: bool | None, T: int) -> list[str]:
    if trace is None and T > TRACE_MAX_TOKENS:
        return [f"no step-by-step trace for {T} tokens (more than {TRACE_MAX_TOKENS}); ask for it "
                "with trace=True (CLI: --steps)"]
    return []


def random_model(
    text: str,
    *,
    seed: int = 0,
    dim: int = 128,
    heads: int = 4,
    positions: bool = False,
    vocab=None,
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
) -> Explanation:
    """The random-weight teaching model: text -> embeddings -> one ``MultiheadAttention``.

    The vocabulary comes from the text (or ``vocab``); the embedding table and the layer's
    weights are drawn from ``np.random.default_rng(seed)``: the maps show how attention
    computes, not meaning. One layer, so ``layer`` is 1 (or -1).

    Args:
        text: the input.
        seed: seed of the Generator that draws the embeddings, then the layer's weights.
        dim: embedding width ``D`` (``embed_dim``).
        heads: number of heads; must divide ``dim``.
        positions: add sinusoidal position codes to the token vectors.
        vocab: a fixed :class:`~attnlab.text.Vocabulary` (or the path of its JSON);
            unknown words become ``<unk>`` with a warning. Default: the text's own words.
        layer, head, trace: see :func:`attnlab.explain.explain`.

    Returns:
        ``attentions`` ``(1, heads, T, T)``, ``static`` (the token vectors, ``(T, D)``),
        ``contextual`` (the layer's output, ``(T, D)``) and the trace.

    Raises:
        ValueError: blank text, only unknown words, ``heads`` not dividing ``dim``,
            non-positive or too large sizes, a layer other than 1.

    >>> e = random_model("The cat sat on the mat")
    >>> e.tokens, e.attentions.shape, e.static.shape, e.contextual.shape
    (['the', 'cat', 'sat', 'on', 'the', 'mat'], (1, 4, 6, 6), (6, 128), (6, 128))
    >>> # no positions: "the" == "the", up to float32 rounding
    >>> bool(np.abs(e.contextual[0] - e.contextual[4]).max() < 1e-6)
    True
    """
    import attnlab
    from attnlab.explain import Explanation
    from attnlab.nn import Embedding
    from attnlab.text.pipeline import check_sizes, text_to_embeddings
    from attnlab.text.tokenizer import Tokenizer
    from attnlab.text.vocab import Vocabulary

    dim = positive_int(dim, "dim")
    heads = positive_int(heads, "heads")
    seed = positive_int(seed, "seed", allow_zero=True)
    if dim % heads:
        raise ValueError(f"heads={heads} must divide dim={dim} (each head gets dim/heads columns)")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    k, h = _place(layer, head, 1, heads)
    tokenizer = Tokenizer()
    tokens = tokenizer(text)
    if not tokens:
        raise ValueError("text is empty: it has no words or punctuation to embed")
    if vocab is None:
        vocab = Vocabulary.from_texts([text], tokenizer=tokenizer)
    elif not isinstance(vocab, Vocabulary):
        vocab = Vocabulary.load(vocab)
    check_sizes(len(tokens), dim, heads, len(vocab))

    rng = np.random.default_rng(seed)
    embedding = Embedding(len(vocab), dim, rng=rng)
    tokens, x = text_to_embeddings(text, vocab, embedding, tokenizer=tokenizer, positions=positions)
    mha = attnlab.MultiheadAttention(dim, heads, bias=False, batch_first=True, rng=rng)
    mha.eval()
    out, weights = mha(x, x, x, average_attn_weights=False)  # (1, T, D), (1, H, T, T)
    T = len(tokens)
    tr = None
    if _want_trace(trace, T):
        tr = attnlab.trace(mha, x, tokens=tokens)
        tr.layer = k  # the model's one layer

    notes = ["random weights: the maps show how attention computes, not what a trained model "
             "has learned"]
    unknown = sorted({t for t in tokens if t not in vocab})
    if unknown:
        notes.append(f"not in the vocabulary, read as <unk>: {', '.join(unknown)}")
    repeated = [w for w, c in Counter(tokens).items() if c > 1]
    if repeated and not positions:
        notes.append("no position codes: equal words (" + ", ".join(repr(w) for w in repeated)
                     + ") get equal contextual vectors")
    notes += _trace_note(trace, T)
    desc = f"random (teaching model): embed_dim {dim}, {heads} heads, seed {seed}"
    if positions:
        desc += ", sinusoidal positions"
    return Explanation(
        text=text, tokens=tokens, model=desc, attentions=weights, static=x[0],
        contextual=out[0], trace=tr, notes=notes, model_name="random", layer=k, head=h,
    )


def minilm_model(
    text: str, *, layer: int | None = None, head: int | None = None, trace: bool | None = None
) -> Explanation:
    """``text`` through the pretrained all-MiniLM-L6-v2 (attnlab's NumPy BERT).

    ``static`` is the tokens' word-embedding rows (layer 0), ``contextual`` the output of
    layer 6, ``attentions`` ``(6, 12, T, T)``. Needs the ``pretrained`` extra
    (``ImportError`` without it).
    """
    import warnings

    from attnlab.explain import Explanation
    from attnlab.models.bert import MINILM_NAME, minilm_available, shared_minilm

    if not minilm_available():
        raise ImportError("the pretrained MiniLM model is not installed")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    model = shared_minilm()
    c = model.config
    k, h = _place(layer, head, c.num_hidden_layers, c.num_attention_heads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analysis = model.analyze(text)
    T = len(analysis.tokens)
    tr = model.trace(text, layer=k) if _want_trace(trace, T) else None
    notes = [
        "static = layer 0, the word-embedding rows (before position embeddings and LayerNorm); "
        f"contextual = output of layer {c.num_hidden_layers}",
        "tokens are BERT word pieces (lower-cased; '##' marks a piece continuing a word)",
    ]
    notes += [str(w.message) for w in caught]
    notes += _trace_note(trace, T)
    return Explanation(
        text=text,
        tokens=analysis.tokens,
        # "name: details" (plot titles use the part before ":")
        model=f"all-MiniLM-L6-v2 (pretrained BERT): {MINILM_NAME}, {c.num_hidden_layers} "
        f"layers, {c.num_attention_heads} heads, {c.hidden_size} dims, run by attnlab in NumPy",
        attentions=analysis.attentions,
        static=analysis.static,
        contextual=analysis.last_hidden_state,
        trace=tr,
        notes=notes,
        model_name="minilm",
        layer=k,
        head=h,
    )


def checkpoint_model(
    text: str,
    *,
    path: str | os.PathLike | None = None,
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
) -> Explanation:
    """A trained associative-recall model (a file from ``attnlab train``) on ``text``.

    ``text`` is a space-separated sequence of the task's tokens, e.g. ``"k1 v5 k2 v9 k1"``.
    The notes point out the induction pattern: in the last layer each repeated key
    attends to the value that followed its first occurrence (which the first layer has
    tagged with that key), and the model predicts that value.

    Raises:
        ValueError: unknown tokens, a text longer than the model's context, a bad file.
    """
    from attnlab.explain import Explanation
    from attnlab.train.checkpoint import load_checkpoint

    if path is None:
        raise ValueError("the 'checkpoint' model needs path=FILE (a checkpoint written by attnlab train)")
    model, task, _meta = load_checkpoint(path)
    c = model.config
    k, h = _place(layer, head, c.n_layers, c.n_heads)
    ids = task.encode(text)
    if len(ids) > c.context_length:
        raise ValueError(f"text has {len(ids)} tokens, but the model's context holds {c.context_length}")
    out = model.inspect(ids)
    tokens = text.split()
    logits = out["logits"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    notes = []
    last = out["attentions"][-1].mean(axis=0)  # (T, T), heads averaged
    for t, tok in enumerate(tokens):
        earlier = [j for j in range(t) if tokens[j] == tok]
        if not tok.startswith("k") or not earlier:
            continue
        j = earlier[0]
        guess = int(probs[t].argmax())
        focus = int(last[t].argmax())
        notes.append(
            f"induction: query {tok!r} at position {t} predicts {task.vocab[guess]!r} "
            f"(p={probs[t, guess]:.2f}); layer {c.n_layers} attends most to position {focus} "
            f"({tokens[focus]!r}); the matching key is at {j}, its value at {j + 1}"
        )
    T = len(tokens)
    tr = None
    if _want_trace(trace, T):
        tr = model.trace(ids, layer=k)
        tr.tokens = list(tokens)
    notes += _trace_note(trace, T)
    return Explanation(
        text=text,
        tokens=tokens,
        model=(f"TinyTransformer ({c.n_layers} layers, {c.n_heads} heads, d_model {c.d_model}) "
               f"trained on associative recall: {Path(path).name}"),
        attentions=out["attentions"].astype(np.float64),
        static=out["static"].astype(np.float64),
        contextual=out["contextual"].astype(np.float64),
        trace=tr,
        notes=notes,
        model_name="checkpoint",
        layer=k,
        head=h,
    )


#: name -> model callable, for :func:`attnlab.explain.explain` and ``attnlab explain --model``.
MODELS: dict[str, Callable[..., Explanation]] = {
    "random": random_model,
    "minilm": minilm_model,
    "checkpoint": checkpoint_model,
}
