"""Decode speed against the memory-bandwidth limit (the library part of
``benchmarks/decode.py`` and of ``attnlab bench``'s decode section; nothing is printed here).

A new token of a small model is memory-bound: each step reads every weight it uses once,
so ``bandwidth / weight bytes per token`` is the fastest decode the machine allows.

- :func:`memory_bandwidth`: bytes/s that ``threads`` threads read from a buffer far larger
  than the last-level cache (a max-reduction over ``int64`` words, one slice a thread, best
  of a few passes).
- :func:`decode_weight_bytes`: the bytes one decode step of a model reads from its weights:
  every block's parameters, the final norm, the unembedding, and one row of each embedding
  table (quantized weights count their packed bytes, :attr:`attnlab.quant.QuantizedTensor.nbytes`).
- :func:`time_decode`: the median tokens/s of greedy decoding after a prompt
  (``generate(n + 1)`` minus ``generate(1)``: the new tokens alone).
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from attnlab._validation import positive_int

__all__ = ["bandwidth_share", "decode_weight_bytes", "memory_bandwidth", "time_decode"]


def memory_bandwidth(*, threads: int | None = None, size_bytes: int | None = None, repeat: int = 5) -> float:
    """Read bandwidth in bytes/s: ``threads`` threads (default: attnlab's thread count) each
    reduce (``max`` over ``int64`` words, NumPy releases the GIL) their slice of one buffer of
    ``size_bytes`` (default: 8 times the last-level cache, at least 256 MiB); the best of
    ``repeat`` passes after one untimed pass.

    >>> memory_bandwidth(threads=1, size_bytes=1 << 20, repeat=1) > 0
    True
    """
    from attnlab._cpu import cpu_info
    from attnlab._threads import get_num_threads

    threads = get_num_threads() if threads is None else positive_int(threads, "threads")
    if size_bytes is None:
        size_bytes = max(256 << 20, 8 * cpu_info().l3)
    words = max(threads, positive_int(size_bytes, "size_bytes") // 8)
    buf = np.ones(words, dtype=np.int64)  # written once: every page is mapped before timing
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            list(pool.map(np.max, parts))
            dt = time.perf_counter() - t0
            if i:
                best = min(best, dt)
    return buf.nbytes / best


def _nbytes(w) -> int:
    return int(w.nbytes)


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter except the embedding tables,
    of which one row each, plus the unembedding (the token embedding's whole table when
    tied). Quantized weights count their packed bytes.

    >>> from attnlab.models.gpt2 import GPT2, GPT2Config
    >>> m = GPT2(GPT2Config(vocab_size=10, n_positions=8, n_embd=4, n_layer=1, n_head=2))
    >>> decode_weight_bytes(m) > 0
    True
    """
    from attnlab.nn.layers import Embedding

    tables = {id(mod.weight): mod for _, mod in model.named_modules() if isinstance(mod, Embedding)}
    total = 0
    for _, p in model.named_parameters():
        mod = tables.get(id(p))
        if mod is None:
            total += _nbytes(p.data)
        else:
            total += _nbytes(p.data) // mod.num_embeddings  # one row
    out = getattr(model, "_W_out", None)
    if out is not None and any(out is mod.weight.data for mod in tables.values()):
        total += _nbytes(out)  # the tied unembedding reads the whole table
    return total


def decode_cache_bytes(model, context: int, *, dtype=None) -> int:
    """Bytes of cached keys and values one decode step reads after ``context`` cached
    tokens: a key row and a value row of ``num_kv_heads * head_dim`` a token for each
    attention layer (its last ``sliding_window`` tokens where it has a window), stored as
    ``dtype`` (a :class:`~attnlab.nn.KVCache` storage dtype; None: float32, the cache of a
    float32 or quantized model; ``"int8"``: a byte a value and a float32 scale a token and
    head). Beside :func:`decode_weight_bytes` it is what a long context adds to a step:
    SmolLM2-135M's cache after 3,000 tokens is 138 MB in float32 beside 112 MB of quantized
    weights.

    >>> from attnlab.models.gpt2 import GPT2, GPT2Config
    >>> m = GPT2(GPT2Config(vocab_size=10, n_positions=8, n_embd=4, n_layer=1, n_head=2))
    >>> [decode_cache_bytes(m, 8, dtype=d) for d in (None, "float16", "int8")]
    [256, 128, 192]
    """
    from attnlab.nn.attention import Attention, cache_dtype

    context = positive_int(context, "context", allow_zero=True)
    dt = cache_dtype(dtype) or np.dtype(np.float32)
    scale = 4 if dt == np.int8 else 0  # an int8 cache's float32 scale, a token and head
    total = 0
    for _, mod in model.named_modules():
        if isinstance(mod, Attention):
            window = mod.sliding_window
            tokens = context if window is None else min(context, window)
            total += 2 * mod.num_kv_heads * (mod.head_dim * dt.itemsize + scale) * tokens
    return total


def bandwidth_share(tokens_per_s: float, bandwidth: float, weight_bytes: int) -> float:
    """The share of the bandwidth limit (``bandwidth / weight_bytes`` tokens/s) reached.

    >>> bandwidth_share(10.0, 1e9, 50_000_000)
    0.5
    """
    return tokens_per_s * weight_bytes / bandwidth


def time_decode(model, input_ids: np.ndarray, new_tokens: int, *, repeat: int = 3) -> dict:
    """Time greedy decoding of ``new_tokens`` after the prompt ``input_ids (1, T)``.

    Each round times ``generate(ids, 1)`` (the prompt and one token) and
    ``generate(ids, new_tokens + 1)``; their difference is ``new_tokens`` decode steps.

    Returns:
        ``{"tokens_per_s", "seconds_per_token", "prefill_s", "decode_s", "new_tokens",
        "weight_bytes", "repeat"}`` (medians over ``repeat`` rounds after one warm-up).
    """
    n = positive_int(new_tokens, "new_tokens")
    ids = np.asarray(input_ids)
    model.generate(ids, 2)  # warm-up: compiled kernels, caches
    firsts, wholes = [], []
    for _ in range(positive_int(repeat, "repeat")):
        t0 = time.perf_counter()
        model.generate(ids, 1)
        t1 = time.perf_counter()
        model.generate(ids, n + 1)
        t2 = time.perf_counter()
        firsts.append(t1 - t0)
        wholes.append(t2 - t1)
    first, whole = statistics.median(firsts), statistics.median(wholes)
    decode = max(whole - first, 1e-9)
    return {"tokens_per_s": n / decode, "seconds_per_token": decode / n, "prefill_s": first, "decode_s": decode,
            "new_tokens": n, "weight_bytes": decode_weight_bytes(model), "repeat": repeat}
