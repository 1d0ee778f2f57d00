"""The compiled decoding step's attention over a long key/value cache, against torch's
``scaled_dot_product_attention`` on the same cache and against the memory's limit.

One new token a layer attends to ``--keys`` cached tokens, layer after layer as a decode step
runs them (SmolLM2's shape: 9 query heads over 3 key/value heads of 64 dims; each layer a
cache of its own, so that together they outgrow the last-level cache as a real model's do).
attnlab runs the step's attention (:func:`attnlab._decode_kernels._attend`, what
:func:`~attnlab._decode_kernels.decode_layer` calls) on the cache as it is stored: float32,
with ``--cache-dtype float16`` the float16 bits, with ``--cache-dtype int8`` the codes
and their scales (:func:`attnlab.nn.attention.quantize_int8`). torch runs
``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on float32 tensors of the same
values (a float16 or int8 cache widened once, before the timing). The limit is the bytes of keys
and values a step reads over the measured read bandwidth
(:func:`attnlab.decode_bench.memory_bandwidth`), measured before and after the steps and
the larger taken: a virtual machine's bandwidth can change from one second to the next (a
2-vCPU EPYC VM: 36 and 63 GB/s in turns, a few seconds each). The two run in turns; times
are medians of ``--repeat`` steps, with each one's largest difference from a float64
reference (the last layer).

    python benchmarks/decode_attention.py [--keys 3040] [--layers 30] [--threads 2]
                                          [--cache-dtype float16|int8] [--repeat 7]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import sys
import time

from _setup import OneLineParser, machine_load, pin_threads, refuse

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention


def parse_args(argv=None):
    p = OneLineParser(prog="decode_attention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=3040, help="cached tokens each query attends to (default 3040)")
    p.add_argument("--layers", type=int, default=30, help="layers, each with its own cache (default 30)")
    p.add_argument("--threads", type=int, default=None, help="threads for both libraries (default: all CPUs)")
    p.add_argument("--cache-dtype", default="float32",
                   help="attnlab's cache storage: float32, float16 or int8 (default float32)")
    p.add_argument("--repeat", type=int, default=7, help="timed steps of each, in turns (default 7)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out")
    return p.parse_args(argv)


def _refusal(args) -> str | None:
    """What is wrong with the arguments, in one line, or None."""
    for name, least in (("keys", 1), ("layers", 1), ("repeat", 1), ("threads", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            return f"--{name} must be at least {least}, got {value}"
    if args.cache_dtype not in ("float32", "float16", "int8"):
        return f"--cache-dtype must be float32, float16 or int8, got {args.cache_dtype!r}"
    return None


def _median_ms(times) -> float:
    times = sorted(times)
    return 1e3 * times[len(times) // 2]


def main(argv=None) -> int:
    args = parse_args(argv)
    refusal = _refusal(args)
    if refusal:
        return refuse("decode_attention.py", refusal)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import numba
    import numpy as np

    from attnlab import _decode_kernels as kernels
    from attnlab._cpu import cpu_info
    from attnlab.decode_bench import memory_bandwidth
    from attnlab.nn.attention import quantize_int8

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("(torch is not installed: attnlab alone)")
    numba_threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(numba_threads)
    if torch is not None:
        torch.set_num_threads(threads)

    S, L, Hq, Hkv, Dh = args.keys, args.layers, HEADS, KV_HEADS, HEAD_DIM
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, (Hq + 2 * Hkv) * Dh)).astype(np.float32)
    caches = []  # per layer: (keys, values, their scales or None) as the step reads them, and as float32
    for _ in range(L):
        k, v = (rng.standard_normal((1, Hkv, S, Dh)).astype(np.float32) for _ in range(2))
        if args.cache_dtype == "float16":
            k, v = k.astype(np.float16), v.astype(np.float16)
            caches.append((k.view(np.uint16), v.view(np.uint16), None, None, k.astype(np.float32),
                           v.astype(np.float32)))
        elif args.cache_dtype == "int8":
            (kc, ks), (vc, vs) = quantize_int8(k), quantize_int8(v)
            caches.append((kc, vc, ks, vs, kc * ks[..., None], vc * vs[..., None]))
        else:
            caches.append((k, v, None, None, k, v))
    scale = 1.0 / np.sqrt(Dh)
    z = np.empty((1, Hq * Dh), np.float32)
    no_mask = np.zeros((0, 0), np.bool_)

    def attnlab_step():
        for k, v, ks, vs, _, _ in caches:
            kernels._attend(qkv, k, v, ks, vs, 0, S, no_mask, Hq, Hkv, Dh, np.float32(scale), np.float32(0.0), z,
                            numba_threads)

    # the float64 reference of the last layer: head h reads key/value head h // (Hq / Hkv)
    q64 = qkv[0, :Hq * Dh].reshape(Hkv, Hq // Hkv, Dh).astype(np.float64)
    k64, v64 = (a[0].astype(np.float64) for a in caches[-1][4:])
    s = np.einsum("hgd,hsd->hgs", q64, k64) * scale
    w = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hgs,hsd->hgd", w / w.sum(-1, keepdims=True), v64).reshape(-1)

    steps = {"attnlab": attnlab_step}
    attnlab_step()  # z: the last layer's output
    diffs = {"attnlab": float(np.abs(z[0] - want).max())}
    if torch is not None:
        import torch.nn.functional as F

        tq = torch.from_numpy(qkv[:, :Hq * Dh].reshape(1, Hq, 1, Dh).copy())
        tcaches = [(torch.from_numpy(k32), torch.from_numpy(v32)) for *_, k32, v32 in caches]

        def torch_step():
            with torch.inference_mode():
                for k, v in tcaches:
                    F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)

        steps["torch float32"] = torch_step
        with torch.inference_mode():
            out = F.scaled_dot_product_attention(tq, *tcaches[-1], enable_gqa=True)
        diffs["torch float32"] = float(np.abs(out.numpy().reshape(-1) - want).max())

    bandwidths = [memory_bandwidth(threads=threads)]  # before the warm-up, whose steps then refill the caches
    for step in steps.values():  # warm up: compile, fault the pages in
        step()
        step()
    times = {name: [] for name in steps}
    for _ in range(args.repeat):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)

    nbytes = sum(a.nbytes for cache in caches for a in cache[:4] if a is not None)
    bandwidths.append(memory_bandwidth(threads=threads))
    bandwidth = max(bandwidths)
    limit_ms = 1e3 * nbytes / bandwidth
    info = cpu_info()
    print(f"cpu      {info.describe()}")
    print(f"threads  {threads} (numba {numba_threads}); numpy {np.__version__}; numba {numba.__version__}"
          + ("" if torch is None else f"; torch {torch.__version__}"))
    print(f"load     before {load_before}; after {machine_load()}")
    print(f"{L} layers x {S} cached tokens, {Hq} query heads over {Hkv} key/value heads of {Dh}, "
          f"{args.cache_dtype} cache: {nbytes / 1e6:.1f} MB of keys and values a step")
    print(f"memory bandwidth ({threads} thread(s)): {bandwidths[0] / 1e9:.1f} GB/s before the steps, "
          f"{bandwidths[1] / 1e9:.1f} after; at {bandwidth / 1e9:.1f}, at best {limit_ms:.2f} ms a step")
    print(f"median of {args.repeat} steps, in turns:")
    base = _median_ms(times["torch float32"]) if "torch float32" in times else None
    print(f"  {'':16}{'ms/step':>9}{'of limit':>10}{'vs torch':>10}   largest difference from float64")
    for name in steps:
        ms = _median_ms(times[name])
        ratio = "" if base is None else f"{ms / base:.2f}x"
        print(f"  {name:16}{ms:9.2f}{limit_ms / ms:10.0%}{ratio:>10}   {diffs[name]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
