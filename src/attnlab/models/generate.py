"""Decoding with attnlab's causal language models, written once for every decoder
(:class:`~attnlab.models.GPT2`, :class:`~attnlab.models.TinyTransformer`).

- :func:`decoder_forward`: token ids (with the tokens already in a key/value cache and
  an optional ``attention_mask``) -> embeddings at their positions -> the causal blocks ->
  logits. Positions follow ``transformers``: without a mask ``past .. past + T - 1``; with
  a mask (1 = real token, left padding) each token's position counts the real tokens
  before it (``cumsum(mask) - 1``; padding gets position 0), so a left-padded prompt gives
  its real tokens the logits of the unpadded prompt.
- :func:`next_token`: the greedy choice (``temperature == 0``) or a sample from
  ``softmax(logits / temperature)`` (optionally among the ``top_k`` likeliest tokens).
- :func:`generate_stream`: the loop, one token at a time as it is chosen. The prompt runs
  once and fills a per-layer :class:`~attnlab.nn.KVCache`; then each step feeds only the
  token just chosen, whose query attends bottom-right causally over every cached key.
  :func:`generate` collects its tokens.

Shapes: ``B`` prompts, ``T`` new tokens in a call, ``P`` tokens already cached, ``V``
vocabulary size, ``D`` model width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from attnlab._threads import DECODE_STEPS
from attnlab._validation import generator, positive_int, shape_error
from attnlab.core import softmax
from attnlab.core._namespace import from_host, is_numpy, namespace, to_host
from attnlab.core.blockwise_xp import matmul_precision
from attnlab.nn import _context
from attnlab.nn.attention import KVCache
from attnlab.nn.attention import cache_dtype as cache_dtype_of

__all__ = ["check_attention_mask", "check_token_ids", "decoder_backward", "decoder_forward", "embed_tokens",
           "embed_tokens_backward", "generate", "generate_stream", "next_token", "position_ids"]


def check_token_ids(input_ids, vocab_size: int, name: str = "input_ids") -> np.ndarray:
    """``input_ids`` as an integer array ``(B, T)`` or ``(T,)`` of ids in ``0..vocab_size-1``.

    >>> check_token_ids([[1, 7]], 5)
    Traceback (most recent call last):
    ...
    ValueError: input_ids holds token id 7, but token ids must lie in [0, 5) (the vocabulary has 5 tokens)

    Ids of another array library (a torch tensor, on any device) are checked on the host: a copy.
    """
    ids = to_host(input_ids)
    if ids.ndim not in (1, 2):
        raise shape_error(name, ids.shape, "(B, T) or (T,)")
    if ids.size == 0 and ids.dtype == np.float64:  # an empty list
        ids = ids.astype(np.int64)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.shape[-1] == 0:
        raise shape_error(name, ids.shape, "(B, T) with T >= 1: at least one token")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, but token ids must lie in [0, {vocab_size}) "
                             f"(the vocabulary has {vocab_size} tokens)")
    return ids


def check_attention_mask(
    attention_mask, shape: tuple[int, ...], *, left_padded: bool = False
) -> np.ndarray | None:
    """``attention_mask`` (bool, or 0/1 integers; 1 = real token) of ``shape`` as a bool
    array, or None when it is None or all ones (nothing is padded).

    With ``left_padded`` each row must be zeros, then ones (at least one): the padding of
    a batch of prompts that will be continued on the right.

    >>> check_attention_mask([[0, 1, 1], [1, 1, 1]], (2, 3), left_padded=True).astype(int)
    array([[0, 1, 1],
           [1, 1, 1]])
    """
    if attention_mask is None:
        return None
    mask = to_host(attention_mask)  # another library's mask (on any device): a host copy
    if mask.shape != tuple(shape):
        raise shape_error("attention_mask", mask.shape, f"{tuple(shape)} (one entry per token, cached "
                          "ones included)")
    if mask.dtype != np.bool_:
        if not (np.issubdtype(mask.dtype, np.integer) or np.issubdtype(mask.dtype, np.floating)) \
                or not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must be boolean or hold only 0 and 1 (1 = real token)")
        mask = mask.astype(bool)
    if left_padded:
        rows = mask.reshape(-1, mask.shape[-1])
        empty = ~rows.any(axis=-1)
        if empty.any():
            raise ValueError(f"attention_mask row {int(np.argmax(empty))} has no real token (all 0)")
        late = (np.diff(rows.astype(np.int8), axis=-1) < 0).any(axis=-1)
        if late.any():
            raise ValueError(f"attention_mask row {int(np.argmax(late))} is not left-padded: a prompt "
                             "to continue must be padded on the left (0s, then 1s)")
    return None if mask.all() else mask


def position_ids(attention_mask: np.ndarray | None, past: int, T: int) -> np.ndarray:
    """The positions of ``T`` new tokens after ``past`` cached ones: ``(T,)`` without a mask,
    else ``(B, T)`` counted over the real tokens (``cumsum(mask) - 1``, padding at 0), as
    ``transformers``' ``generate`` computes them.

    >>> position_ids(None, 2, 3)
    array([2, 3, 4])
    >>> position_ids(np.array([[False, True, True], [True, True, True]]), 0, 3)
    array([[0, 0, 1],
           [0, 1, 2]])
    """
    if attention_mask is None:
        return np.arange(past, past + T)
    pos = np.cumsum(attention_mask, axis=-1) - 1
    pos[~attention_mask] = 0
    return pos[..., past:]


def embed_tokens(tok_emb, pos_emb, hook_embed, hook_pos_embed, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token plus learned position embeddings ``(..., T, D)``, through the hook points
    ``hook_embed`` and ``hook_pos_embed`` (the latter sees the batch's shape, as
    TransformerLens's)."""
    x = hook_embed(tok_emb(ids))  # a fresh array (a hook's replacement is copied)
    p = pos_emb(positions)
    if hook_pos_embed.hooked:  # a copy of the batch's shape (in the tables' library)
        p = hook_pos_embed(np.ascontiguousarray(np.broadcast_to(p, x.shape)) if type(p) is np.ndarray
                           else namespace(p).broadcast_to(p, x.shape) * 1)
    x += p
    return x


def embed_tokens_backward(tok_emb, pos_emb, hook_embed, hook_pos_embed, grad: np.ndarray) -> None:
    """The backward pass of :func:`embed_tokens`: ``grad`` ``(..., T, D)`` of its output
    through both hook points into both tables' ``.grad`` (the position table's summed over
    the sequences that share positions)."""
    tok_emb.backward(hook_embed.backward(grad))
    pos_emb.backward(hook_pos_embed.backward(grad))


def cache_length(cache, n_layers: int) -> int:
    """The number of cached tokens of a per-layer cache (a list of ``n_layers``
    :class:`~attnlab.nn.KVCache`), 0 for None."""
    if cache is None:
        return 0
    if not isinstance(cache, list | tuple) or len(cache) != n_layers or not all(
        isinstance(c, KVCache) for c in cache
    ):
        raise TypeError(
            f"cache must be a list of {n_layers} KVCache (model.new_cache()), got {type(cache).__name__}"
        )
    return cache[0].length


def decoder_forward(
    input_ids,
    attention_mask,
    cache,
    *,
    embed: Callable[[np.ndarray, np.ndarray], np.ndarray],
    blocks: Sequence,
    head: Callable[[np.ndarray], np.ndarray],
    vocab_size: int,
    n_positions: int,
    positions_name: str,
    ids_name: str = "input_ids",
    logits_to_keep: int | None = None,
    checkpoint: dict | None = None,
) -> np.ndarray:
    """The forward pass of a causal decoder: ``embed(ids, positions)`` -> every block (causal,
    with the key padding mask, its layer's cache and the positions) -> ``head`` (final norm and output
    layer) -> logits ``(..., T, V)`` (``(..., logits_to_keep, V)``: only the last ones).

    ``positions_name`` names the model's limit on positions in errors
    (``"n_positions"``, ``"context_length"``), ``ids_name`` the ids' argument. The hidden
    states and maps are recorded through the blocks' hook points
    (:func:`attnlab.nn.hooks.record_layers`).

    ``checkpoint`` (a dict, in a training call without hooks): activation checkpointing.
    Each block's input and its random generators' states are kept there, and what the
    block kept for backward is dropped as soon as it returns; :func:`decoder_backward`
    recomputes the block from them.
    """
    past = cache_length(cache, len(blocks))
    ids = check_token_ids(input_ids, vocab_size, ids_name)
    T = ids.shape[-1]
    if past + T > n_positions:
        need = f"(B, T) with 1 <= T <= {positions_name}={n_positions}"
        if past:
            need += f" - {past} cached tokens"
        raise shape_error(ids_name, ids.shape, need)
    mask = check_attention_mask(attention_mask, (*ids.shape[:-1], past + T))
    if logits_to_keep is not None:
        logits_to_keep = min(positive_int(logits_to_keep, "logits_to_keep"), T)
    # A decoding step keeps every BLAS thread: its matrix-vector products are bound by
    # memory, and two threads read it faster than one (SmolLM2 on a 2-core EPYC: 30 against
    # 49 ms per token; 35 against 52 after a 512-token prompt) -- on a quiet machine;
    # generate() runs each step on one thread where that is faster now (StepThreads).
    positions = position_ids(mask, past, T)
    x = embed(ids, positions)
    if mask is not None and type(x) is not np.ndarray:  # weights of another library: the mask goes there
        mask = from_host(mask, x)
    if checkpoint is not None:
        checkpoint.update(mask=mask, positions=positions, inputs=[])
    with full_precision(x), _all_or_nothing(cache, past):
        for i, block in enumerate(blocks):
            layer_cache = None if cache is None else cache[i]
            if checkpoint is not None:
                checkpoint["inputs"].append((x, [(g, g.bit_generator.state) for g in _generators(block)]))
            x = block(x, key_padding_mask=mask, cache=layer_cache, positions=positions)
            if checkpoint is not None:  # only the block's input is kept: the rest is recomputed
                tape = _context.tape()
                for _, m in block.named_modules():
                    tape.drop(m)
        if logits_to_keep is not None:
            x = x[..., T - logits_to_keep :, :]
        return head(x)


@contextlib.contextmanager
def _all_or_nothing(cache, past: int):
    """A forward pass that raises part-way (a value beyond a float16 cache's range, a hook
    that raises, Ctrl-C) leaves every layer's cache as it was (:meth:`KVCache.crop` to the
    ``past`` tokens it held), not the first blocks with the new tokens and the others
    without."""
    try:
        yield
    except BaseException:
        for c in cache or ():
            c.crop(past)
        raise


def full_precision(x):
    """A context in which a forward pass on ``x`` multiplies at its dtype's full precision:
    for JAX arrays, whose GPU default is TF32 for float32 products (see
    :func:`attnlab.core.blockwise_xp.matmul_precision`); nothing for the others."""
    if type(x) is np.ndarray:
        return contextlib.nullcontext()
    return matmul_precision(namespace(x))


def decoder_backward(grad_h: np.ndarray, tokens: int, *, blocks: Sequence, embed_backward: Callable,
                     checkpoint: dict | None = None) -> None:
    """The backward pass of :func:`decoder_forward` below its head: ``grad_h`` ``(..., k, D)``,
    the gradient of the final norm's input at the ``k`` positions whose logits were kept
    (``logits_to_keep``; the others get none), through every block in reverse to
    ``embed_backward`` (the gradient of the embeddings' output, ``(..., tokens, D)``).

    With the forward pass's ``checkpoint``, each block first runs its forward pass again
    from its kept input (training mode, its dropout generators set back to where they
    stood, no hooks), which keeps what its backward pass then reads."""
    g = grad_h
    if g.shape[-2] != tokens:
        g = np.zeros((*grad_h.shape[:-2], tokens, grad_h.shape[-1]), dtype=grad_h.dtype)
        g[..., tokens - grad_h.shape[-2]:, :] = grad_h
    inputs = checkpoint["inputs"] if checkpoint is not None else None
    for i in reversed(range(len(blocks))):
        if inputs is not None:
            _recompute(blocks[i], *inputs.pop(), checkpoint["mask"], checkpoint["positions"])
        g = blocks[i].backward(g)
    embed_backward(g)


def _generators(block) -> list[np.random.Generator]:
    """The random generators of ``block``'s modules (dropout), each once."""
    out: dict[int, np.random.Generator] = {}
    for _, m in block.named_modules():
        g = m.__dict__.get("_rng")
        if isinstance(g, np.random.Generator):
            out.setdefault(id(g), g)
    return list(out.values())


def _recompute(block, x, states, mask, positions) -> None:
    """``block``'s forward pass on ``x`` again, for its backward pass: its generators drawn
    from the states they had in the first pass, then set back to where they stand now."""
    now = [(g, g.bit_generator.state) for g, _ in states]
    for g, state in states:
        g.bit_generator.state = state
    try:
        with _context.detached():
            block(x, key_padding_mask=mask, cache=None, positions=positions)
    finally:
        for g, state in now:
            g.bit_generator.state = state


def next_token(
    logits: np.ndarray,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The next token of each row of ``logits (B, V)``: ``(B,)`` int64.

    ``temperature == 0``: the likeliest token (the first on ties, as ``argmax``). Else a
    sample from ``softmax(logits / temperature)`` drawn with ``rng``, restricted to the
    ``top_k`` likeliest tokens (ties with the ``top_k``-th kept) when ``top_k`` is given.
    A temperature so small that ``logits / temperature`` overflows samples among the
    largest logits only (greedy, up to ties), never from NaN.

    Raises:
        ValueError: NaN or ``+inf`` logits, or a row of only ``-inf`` (greedy or sampled).

    >>> next_token(np.array([[0.1, 2.0, -1.0]]))
    array([1])
    >>> next_token(np.array([[0.1, 2.0, -1.0]]), temperature=1.0, top_k=1, rng=np.random.default_rng(0))
    array([1])
    >>> next_token(np.array([[0.1, 2.0, -1.0]]), temperature=1e-310, rng=np.random.default_rng(0))
    array([1])
    """
    temperature, top_k = _check_sampling(temperature, top_k)
    logits = to_host(logits)  # another library's logits (on any device): a host copy
    if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any(axis=-1).all():
        raise ValueError("logits must be finite (or -inf for a token never to be drawn), with at "
                         "least one finite entry per row: cannot pick the next token from NaN or +inf")
    if temperature == 0.0:
        return logits.argmax(axis=-1).astype(np.int64)
    rng = generator(rng)
    z = logits.astype(np.float64)
    # Shifted so the largest is 0 before dividing: however small the temperature, nothing
    # overflows to +inf (a tiny one sends every other token to -inf: greedy in the limit).
    z -= z.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        z /= temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[..., -top_k, None]
        z[z < kth] = -np.inf
    cdf = np.cumsum(softmax(z, axis=-1), axis=-1)
    u = rng.random(z.shape[:-1])[..., None] * cdf[..., -1:]
    choice = (cdf <= u).sum(axis=-1)  # the first index whose cumulative mass exceeds u
    return np.minimum(choice, z.shape[-1] - 1).astype(np.int64)


def _check_sampling(temperature, top_k) -> tuple[float, int | None]:
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.integer | np.floating):
        raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not (np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None:
        top_k = positive_int(top_k, "top_k")
        if temperature == 0.0:
            raise ValueError(f"top_k={top_k} needs sampling (temperature > 0); greedy decoding "
                             "takes the likeliest token")
    return temperature, top_k


def _eos_ids(eos_token_id) -> np.ndarray | None:
    if eos_token_id is None:
        return None
    ids = np.atleast_1d(np.asarray(eos_token_id))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}")
    return ids.astype(np.int64)


def generate(
    model,
    input_ids,
    max_new_tokens: int,
    *,
    vocab_size: int,
    n_positions: int,
    positions_name: str = "n_positions",
    attention_mask=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng: np.random.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache_dtype=None,
) -> np.ndarray:
    """Continue ``input_ids`` by ``max_new_tokens`` tokens with a key/value cache: the tokens
    of :func:`generate_stream`, collected.

    ``model`` is a decoder: ``model.new_cache()`` gives an empty per-layer cache and
    ``model(ids, attention_mask=..., cache=..., logits_to_keep=1)`` the logits of the last
    new token. The prompt runs once; each step then runs only the chosen token. With
    ``eos_token_id`` a row that has produced it is finished: it continues with
    ``eos_token_id`` (the first, for a list) and the loop stops when every row is
    finished, as ``transformers``' ``generate`` does without a ``pad_token_id``.

    Args:
        model: the decoder.
        input_ids: ``(B, T)`` or ``(T,)`` prompts, left-padded to one length.
        max_new_tokens: how many tokens to add (0: the prompt back).
        vocab_size, n_positions, positions_name: the model's vocabulary size and its
            limit on positions (and that limit's name, for errors).
        attention_mask: ``(B, T)`` (``(T,)``) 1 for real tokens, 0 for the left padding.
        temperature, top_k, rng: see :func:`next_token`.
        eos_token_id: the token (or tokens) that ends a sequence; None: never stop early.
        cache_dtype: the cache's storage dtype, ``model.new_cache(dtype=cache_dtype)``
            (None: ``model.new_cache()``, the keys' own dtype; ``"float16"``: half the
            memory, ``"int8"``: about a quarter, see :class:`attnlab.nn.KVCache`).

    Returns:
        ``(B, T + n)`` int64 (``(T + n,)`` for one prompt): the prompts, then the ``n <=
        max_new_tokens`` new tokens; an array of the prompt's library and device when
        ``input_ids`` is another library's (a model moved with ``model.to(torch)``), else
        NumPy. Each step's choice is made on the host from a copy of its last logits.
    """
    run = _Generation(input_ids, max_new_tokens, vocab_size=vocab_size, n_positions=n_positions,
                      positions_name=positions_name, attention_mask=attention_mask, temperature=temperature,
                      top_k=top_k, rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype)
    rows, T = run.rows, run.rows.shape[1]
    out = np.empty((len(rows), T + run.max_new_tokens), dtype=np.int64)
    out[:, :T] = rows
    n = 0
    for token in run.steps(model):
        out[:, T + n] = token
        n += 1
    out = out[:, : T + n]
    out = out[0] if run.single else out
    return out if run.like is None else from_host(out, run.like)


def generate_stream(
    model,
    input_ids,
    max_new_tokens: int,
    *,
    vocab_size: int,
    n_positions: int,
    positions_name: str = "n_positions",
    attention_mask=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng: np.random.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    cache_dtype=None,
) -> Iterator:
    """:func:`generate`, one step at a time: an iterator over the new tokens, each given as
    soon as it is chosen (the first right after the prompt's forward pass).

    The arguments are :func:`generate`'s and are checked when this is called, before any
    token is made. Each item is the step's token of every prompt, ``(B,)`` int64 (NumPy,
    whatever the prompt's library), or an ``int`` for one prompt ``(T,)``. The iterator ends
    after ``max_new_tokens`` steps, or when every row has produced ``eos_token_id`` (that
    step included). Stopping early (``break``, Ctrl-C) keeps what was yielded and computes
    nothing more.

    >>> class Echo:  # a decoder whose next token is always the last token + 1
    ...     def new_cache(self): return []
    ...     def __call__(self, ids, attention_mask=None, cache=None, logits_to_keep=None):
    ...         return np.eye(10)[ids[:, -1:] + 1]
    >>> list(generate_stream(Echo(), np.array([1, 2]), 3, vocab_size=10, n_positions=10))
    [3, 4, 5]
    """
    run = _Generation(input_ids, max_new_tokens, vocab_size=vocab_size, n_positions=n_positions,
                      positions_name=positions_name, attention_mask=attention_mask, temperature=temperature,
                      top_k=top_k, rng=rng, eos_token_id=eos_token_id, cache_dtype=cache_dtype)
    steps = run.steps(model)
    return (int(t[0]) for t in steps) if run.single else steps


class _Generation:
    """The checked arguments of one generation and its loop (:meth:`steps`)."""

    def __init__(self, input_ids, max_new_tokens, *, vocab_size, n_positions, positions_name, attention_mask,
                 temperature, top_k, rng, eos_token_id, cache_dtype=None):
        ids = check_token_ids(input_ids, vocab_size)
        self.max_new_tokens = positive_int(max_new_tokens, "max_new_tokens", allow_zero=True)
        self.temperature, self.top_k = _check_sampling(temperature, top_k)
        self.eos = _eos_ids(eos_token_id)
        self.cache_dtype = cache_dtype_of(cache_dtype)
        self.rng = generator(rng) if self.temperature > 0 else rng
        T = ids.shape[-1]
        if T + self.max_new_tokens > n_positions:
            raise ValueError(f"the prompt has {T} tokens and max_new_tokens={self.max_new_tokens}: "
                             f"{T + self.max_new_tokens} positions, but the model has {positions_name}={n_positions}")
        mask = check_attention_mask(attention_mask, ids.shape, left_padded=True)
        self.single = ids.ndim == 1
        self.like = None if is_numpy(input_ids) else input_ids  # the tokens go back to the prompt's library
        self.rows = ids.astype(np.int64).reshape(-1, T)
        self.mask = None if mask is None else mask.reshape(self.rows.shape)

    def steps(self, model) -> Iterator[np.ndarray]:
        """Each step's tokens ``(B,)``: the prompt runs once and fills a cache, each step
        then runs only the tokens just chosen."""
        if self.max_new_tokens == 0:
            return
        B = len(self.rows)
        cache = model.new_cache() if self.cache_dtype is None else model.new_cache(dtype=self.cache_dtype)
        finished = np.zeros(B, dtype=bool)
        step_ids, mask = self.rows, self.mask
        for n in range(self.max_new_tokens):
            if n == 0:  # the prompt
                logits = model(step_ids, attention_mask=mask, cache=cache, logits_to_keep=1)
            else:  # a decoding step, on the threads that run it fastest now (see StepThreads)
                with DECODE_STEPS.step(first=n == 1):
                    logits = model(step_ids, attention_mask=mask, cache=cache, logits_to_keep=1)
            logits = to_host(logits)[:, -1]  # (B, V); another library's (on any device): a host copy
            token = next_token(logits, temperature=self.temperature, top_k=self.top_k, rng=self.rng)
            if self.eos is not None:
                token[finished] = self.eos[0]
                finished |= np.isin(token, self.eos)
            yield token
            if finished.all() or n + 1 == self.max_new_tokens:
                return
            step_ids = token[:, None]
            if mask is not None:
                mask = np.concatenate([mask, np.ones((B, 1), dtype=bool)], axis=1)
