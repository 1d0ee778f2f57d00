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
from attnlab.text.tokens import readable_token, readable_tokens, token_scheme

if TYPE_CHECKING:
    from attnlab.explain import Explanation

#: With ``trace=None`` the trace is recorded for texts of at most this many tokens (a trace
#: keeps several ``(T, T)`` arrays per head, and the report embeds them all).
TRACE_MAX_TOKENS = 64


def _place(layer, head, n_layers: int, n_heads: int) -> tuple[int, int]:
    """``(layer 1..n, head 0..H-1)`` from the caller's choice (defaults: last layer, head 0)."""
    from attnlab.explain import _head_index

    k = n_layers if layer is None else layer_number(layer, n_layers, embeddings=False)
    return k, _head_index(0 if head is None else head, n_heads)


def unknown_note(n: int, T: int, unk: str) -> str:
    """The note that says how many tokens became the unknown token.

    >>> unknown_note(3, 10, "[UNK]")
    '3 of 10 tokens became [UNK], the unknown token: their vectors say nothing about the text they replaced'
    """
    return (f"{n} of {T} token{'s' * (T != 1)} became {unk}, the unknown token: their vectors say "
            "nothing about the text they replaced")


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
    n_unknown = sum(t not in vocab for t in tokens)
    if unknown:
        notes.append(unknown_note(n_unknown, len(tokens), "<unk>") + f": {', '.join(unknown)}")
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
        unknown=n_unknown,
    )


def minilm_model(
    text: str, *, layer: int | None = None, head: int | None = None, trace: bool | None = None
) -> Explanation:
    """``text`` through the pretrained all-MiniLM-L6-v2 (attnlab's NumPy BERT).

    ``static`` is the tokens' word-embedding rows (layer 0), ``contextual`` the output of
    layer 6, ``attentions`` ``(6, 12, T, T)``, ``rollout`` the attention rollout of those
    maps (:func:`attnlab.inspect.attention_rollout`, ``(6, T, T)``). Needs the
    ``pretrained`` extra (``ImportError`` without it).
    """
    import warnings

    from attnlab.explain import Explanation
    from attnlab.inspect import attention_rollout
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
    unk = getattr(model.tokenizer.model, "unk_token", None) or "[UNK]"
    n_unknown = sum(t == unk for t in analysis.tokens)
    if n_unknown:
        notes.append(unknown_note(n_unknown, T, unk) + " (characters outside its vocabulary, such as "
                     "most Chinese characters and emoji)")
    notes += [str(w.message) for w in caught]
    notes += _trace_note(trace, T)
    maps = np.asarray(analysis.attentions)  # (N, H, T, T): each block's hook_pattern
    rollout = attention_rollout(model, {f"blocks.{i}.attn.hook_pattern": maps[i][None] for i in range(len(maps))})
    return Explanation(
        rollout=rollout[:, 0],
        unknown=n_unknown,
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


def induction_notes(
    tokens: list[str],
    attentions: np.ndarray,
    probs: np.ndarray | None = None,
    vocab: list[str] | None = None,
    *,
    keys_only: bool = False,
    any_layer: bool = False,
    limit: int | None = None,
) -> list[str]:
    """Notes on the induction pattern: a token seen before (first at ``j``) attends to the
    token that followed it there (``j + 1``), and so can predict it.

    For each such token at ``t`` (``j + 1 < t``; only keys ``k…`` with ``keys_only``): the
    head that attends most to ``j + 1`` (in the last layer, or in any layer with
    ``any_layer``), where that head attends most, and, with ``probs (T, V)`` and
    ``vocab``, the predicted next token. The pattern holds where that head's strongest
    weight is on ``j + 1``. At most ``limit`` notes, then one that counts the rest.

    Args:
        tokens: the ``T`` tokens.
        attentions: ``(n_layers, H, T, T)`` causal maps.
        probs: next-token probabilities ``(T, V)``, or None.
        vocab: token strings by id (with ``probs``).
        keys_only: only tokens starting with ``k`` (the recall task's keys) are queries.
        any_layer: look for the head in every layer, not only the last.
        limit: the most notes on single tokens (None: all).

    >>> maps = np.zeros((1, 2, 4, 4)); maps[..., 0, 0] = maps[..., 1, 1] = maps[..., 2, 2] = 1
    >>> maps[0, 1, 3, 1] = 0.9; maps[0, 1, 3, 3] = 0.1; maps[0, 0, 3, 3] = 1
    >>> induction_notes(["a", "b", "c", "a"], maps)
    ["induction: query 'a' at position 3: layer 1 head 1 attends most to position 1 ('b') (weight 0.90), \
the token after the earlier 'a' at 0: the induction pattern"]
    """
    n_layers = attentions.shape[0]
    first = 0 if any_layer else n_layers - 1
    notes = []
    for t, tok in enumerate(tokens):
        earlier = [j for j in range(t - 1) if tokens[j] == tok]
        if not earlier or (keys_only and not tok.startswith("k")):
            continue
        j = earlier[0]
        on_next = attentions[first:, :, t, j + 1]  # (layers, H)
        layer, h = np.unravel_index(int(on_next.argmax()), on_next.shape)
        w = attentions[first + layer, h, t]
        focus = int(w.argmax())
        note = f"induction: query {tok!r} at position {t}"
        if probs is not None and vocab is not None:
            guess = int(probs[t].argmax())
            verdict = "right" if vocab[guess] == tokens[j + 1] else f"the earlier pair says {tokens[j + 1]!r}"
            note += f" predicts {vocab[guess]!r} (p={probs[t, guess]:.2f}, {verdict})"
        where = f"layer {first + layer + 1} head {h} attends most to position {focus} ({tokens[focus]!r}) " \
                f"(weight {w[focus]:.2f})"
        if focus == j + 1:
            note += f": {where}, the token after the earlier {tok!r} at {j}: the induction pattern"
        else:
            note += (f": {where}, not to the token after the earlier {tok!r} at {j} (position {j + 1}, "
                     f"weight {w[j + 1]:.2f}): no induction pattern here")
        notes.append(note)
    if limit is not None and len(notes) > limit:
        shown = sum(n.endswith("the induction pattern") for n in notes)
        notes = notes[:limit] + [f"induction: {len(notes) - limit} more repeated tokens not listed; "
                                 f"{shown} of all {len(notes)} show the induction pattern"]
    return notes


def checkpoint_model(
    text: str,
    *,
    path: str | os.PathLike | None = None,
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
    corrupt: str | None = None,
    attribute: bool = False,
) -> Explanation:
    """A trained associative-recall model (a file from ``attnlab train``) on ``text``.

    ``text`` is a space-separated sequence of the task's tokens, e.g. ``"k1 v5 k2 v9 k1"``.
    The notes point out the induction pattern: in the last layer each repeated key
    attends to the value that followed its first occurrence (which the first layer has
    tagged with that key), and the model predicts that value. The logit lens and the head
    detector scores are filled in, and with ``corrupt`` (a text of as many tokens)
    activation patching (see :func:`attnlab.explain.inside.decoder_inside`).

    Raises:
        ValueError: unknown tokens, a text longer than the model's context, a bad file.
    """
    from attnlab.core import softmax
    from attnlab.explain import Explanation
    from attnlab.explain.inside import decoder_inside
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
    probs = softmax(out["logits"], axis=-1)
    notes = induction_notes(tokens, out["attentions"], probs, task.vocab, keys_only=True)
    T = len(tokens)
    tr = None
    if _want_trace(trace, T):
        tr = model.trace(ids, layer=k)
        tr.tokens = list(tokens)
    notes += _trace_note(trace, T)
    lens, scores, patching = decoder_inside(model, np.asarray(ids), task.vocab, corrupt=corrupt,
                                            encode=lambda s: (task.encode(s), s.split()))
    attribution = _attribution(model, np.asarray(ids), lens, task.vocab, patching, corrupt,
                               lambda s: (task.encode(s), s.split())) if attribute else None
    return Explanation(
        attribution=attribution,
        lens=lens,
        head_scores=scores,
        patching=patching,
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


def gpt2_model(
    text: str,
    *,
    path: str | os.PathLike | None = None,
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
    corrupt: str | None = None,
    attribute: bool = False,
) -> Explanation:
    """A decoder folder or file on ``text``: GPT-2, Llama, Mistral, Qwen2 or Qwen3
    (``config.json``, the weights, optionally ``tokenizer.json``; or a ``.gguf`` file), as
    :func:`attnlab.models.from_pretrained` reads it. See :func:`decoder_explanation`.

    Raises:
        ValueError: no ``path``, a text longer than the context, ids that are not numbers or
            outside the vocabulary (without a tokenizer), an encoder's folder.
        CheckpointError: a folder of no supported family (the supported ones are listed).
    """
    from attnlab.models.registry import detect, from_pretrained

    if path is None:
        raise ValueError("the 'gpt2' model needs path=FOLDER (config.json and model.safetensors) or a .gguf file")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    family = detect(path)
    if not family.decoder or family.name == "tiny":
        raise ValueError(f"{path} holds a {family.name} model; this view needs a decoder folder or .gguf file")
    return decoder_explanation(from_pretrained(path), text, layer=layer, head=head, trace=trace,
                               source=Path(path).name, model_name="gpt2" if family.name == "gpt2" else family.name,
                               corrupt=corrupt, attribute=attribute)


def smollm2_model(
    text: str,
    *,
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
    corrupt: str | None = None,
    attribute: bool = False,
) -> Explanation:
    """The bundled SmolLM2-135M-Instruct (``make demo`` installs it) on ``text``, as is
    (no chat template): 30 blocks of 9 query heads over 3 key/value heads, rotary positions.

    Raises:
        ModuleNotFoundError: SmolLM2 or the ``gguf`` extra is not installed.
    """
    from attnlab.models.llama import load_smollm2

    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return decoder_explanation(load_smollm2(), text, layer=layer, head=head, trace=trace, source="",
                               model_name="smollm2", corrupt=corrupt, attribute=attribute)


def _head_groups(num_heads: int, num_kv_heads: int) -> str:
    """How query heads share key/value heads, for the notes."""
    G = num_heads // num_kv_heads
    groups = [f"{g * G}-{g * G + G - 1}" if G > 1 else f"{g}" for g in range(num_kv_heads)]
    return (f"grouped-query attention: {num_heads} query heads share {num_kv_heads} key/value heads; query heads "
            + ", ".join(f"{grp} read key/value head {g}" for g, grp in enumerate(groups))
            + " (their maps differ only through their queries)")


class _Readable:
    """A vocabulary (token strings by id) read as text, one looked-up token at a time."""

    def __init__(self, vocab: list[str], scheme: str):
        self.vocab, self.scheme = vocab, scheme

    def __getitem__(self, i: int) -> str:
        return readable_token(self.vocab[i], self.scheme)


def decoder_explanation(
    model, text: str, *, layer: int | None, head: int | None, trace: bool | None, source: str, model_name: str,
    corrupt: str | None = None, attribute: bool = False,
) -> Explanation:
    """Any causal decoder with a tokenizer (or token ids) on ``text``.

    With a tokenizer ``text`` is tokenized (byte-level BPE: ``Ġ`` marks a leading space, shown
    as ``␣``, see :func:`attnlab.text.readable_token`);
    without one it must be space-separated token ids (``"464 3797 3332"``). The maps are
    causal: each token attends to itself and the tokens before it. ``static`` is layer 0
    (the embeddings), ``contextual`` the last block's output after the final norm. The
    notes give the predicted next token, how query heads share key/value heads (grouped
    query attention) and, for repeated tokens, whether some head (in any layer) shows the
    induction pattern. The logit lens and the head detector scores are filled in, and
    with ``corrupt`` (a text of as many tokens) activation patching (see
    :func:`attnlab.explain.inside.decoder_inside`); with ``attribute`` the input attribution
    of the predicted token and, with ``corrupt``, attribution patching and the EAP-IG
    circuit (:func:`attnlab.explain.attribution.decoder_attribution`). Everything is read
    from the model's hook points.

    Raises:
        ValueError: a text longer than the context, ids that are not numbers or outside
            the vocabulary (without a tokenizer), a corrupted text of a different length.
    """
    from attnlab.core import softmax
    from attnlab.explain import Explanation
    from attnlab.explain.inside import decoder_inside

    c = model.config
    attn = model.layers[0].attn
    n_layers, n_heads = len(model.layers), attn.num_heads
    k, h = _place(layer, head, n_layers, n_heads)
    if model.tokenizer is not None:
        vocab = [model.tokenizer.id_to_token(i) or str(i) for i in range(c.vocab_size)]
    else:
        vocab = [str(i) for i in range(c.vocab_size)]

    def encode(text: str) -> tuple[np.ndarray, list[str]]:
        if model.tokenizer is not None:
            return model.encode(text)
        words = text.split()
        if not words or not all(w.isdigit() for w in words):
            raise ValueError(f"{source or 'the model'} has no tokenizer.json: give the text as space-separated "
                             f"token ids in 0..{c.vocab_size - 1}, e.g. '1 2 3'")
        return np.array([int(w) for w in words], dtype=np.int64), words

    ids, tokens = encode(text)
    T = len(ids)
    scheme = token_scheme(model.tokenizer) if model.tokenizer is not None else "plain"
    if T > model.max_positions:
        raise ValueError(f"text has {T} tokens, but the model's context holds {model.max_positions}")
    out = model.inspect(ids[None])
    probs = softmax(out.logits[0].astype(np.float64), axis=-1)
    nxt = int(probs[-1].argmax())
    shown = readable_token(vocab[nxt], scheme)
    notes = [
        "causal maps: each token attends only to itself and earlier tokens (every entry above the "
        "diagonal is 0)",
        f"the predicted next token after the text: {shown!r} (id {nxt}, p={probs[-1, nxt]:.2f})",
    ]
    if attn.num_kv_heads != n_heads:
        notes.append(_head_groups(n_heads, attn.num_kv_heads))
    if scheme != "plain":
        notes.append(f"tokens are {scheme} pieces, shown as text: '\u2423' marks a space, <0xNN> a byte of a "
                     "character split across tokens (the JSON keeps them as the tokenizer writes them)")
    unk = getattr(getattr(model.tokenizer, "model", None), "unk_token", None) if model.tokenizer else None
    n_unknown = sum(t == unk for t in tokens) if unk else 0
    if n_unknown:
        notes.append(unknown_note(n_unknown, T, unk))
    notes += induction_notes(readable_tokens(tokens, scheme), out.attentions[:, 0], probs, _Readable(vocab, scheme),
                             any_layer=True, limit=8)
    tr = model.trace(ids, layer=k, tokens=readable_tokens(tokens, scheme)) if _want_trace(trace, T) else None
    notes += _trace_note(trace, T)
    heads = f"{n_heads} heads" if attn.num_kv_heads == n_heads else \
        f"{n_heads} query heads over {attn.num_kv_heads} key/value heads"
    where = f": {source}" if source else ""
    lens, scores, patching = decoder_inside(model, np.asarray(ids), vocab, corrupt=corrupt, encode=encode)
    attribution = _attribution(model, np.asarray(ids), lens, vocab, patching, corrupt, encode) if attribute else None
    return Explanation(
        attribution=attribution,
        lens=lens,
        head_scores=scores,
        patching=patching,
        text=text,
        tokens=tokens,
        model=(f"{model.name} ({n_layers} layers, {heads}, width {attn.embed_dim}, vocabulary "
               f"{c.vocab_size}){where}, run by attnlab in NumPy"),
        attentions=out.attentions[:, 0].astype(np.float64),
        static=out.hidden_states[0, 0].astype(np.float64),
        contextual=model.ln_final(out.hidden_states[-1, 0]).astype(np.float64),
        trace=tr,
        notes=notes,
        model_name=model_name,
        layer=k,
        head=h,
        unknown=n_unknown,
        token_scheme=scheme,
    )


def _attribution(model, ids, lens, vocab, patching, corrupt, encode):
    """``explain --attribute``: the predicted token's input attribution and, with a
    corrupted text, attribution patching and the circuit."""
    from attnlab.explain.attribution import decoder_attribution

    target = int(lens.ids[-1, -1, 0])  # the model's prediction after the text
    name = vocab(target) if callable(vocab) else vocab[target]
    corrupted_ids = None if corrupt is None else np.asarray(encode(corrupt)[0])
    return decoder_attribution(model, ids, target, str(name), patching=patching, corrupted_ids=corrupted_ids)


#: name -> model callable, for :func:`attnlab.explain.explain` and ``attnlab explain --model``.
MODELS: dict[str, Callable[..., Explanation]] = {
    "random": random_model,
    "minilm": minilm_model,
    "checkpoint": checkpoint_model,
    "gpt2": gpt2_model,
    "smollm2": smollm2_model,
}
