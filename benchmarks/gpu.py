"""attnlab on a GPU against torch's own kernels and transformers, on the same card.

Scaled dot-product attention in float32, bfloat16 and float16 (times, errors against
float64, extra memory at L = 8192), ``MultiheadAttention(512, 8)``, JAX and CuPy arrays, and
a SmolLM2-shaped decoder's prefill and decode against transformers.

attnlab computes on the GPU through the Array API path: its core takes torch (CuPy, JAX)
arrays and stays on their device, and a model moves there with ``model.to(torch,
device="cuda")``. torch's side is ``torch.nn.functional.scaled_dot_product_attention`` (its
fused kernels: FlashAttention, memory-efficient, cuDNN, chosen by torch),
``torch.nn.MultiheadAttention`` and transformers' ``LlamaForCausalLM`` (its default
attention, torch's SDPA).

- Times: each pair runs in turns, after warm-up calls, the device synchronised around every
  call; medians of ``--repeat`` calls.
- Errors: the largest absolute difference from the same call in float64 (torch's math
  kernel on the same inputs), for attnlab and torch; their ratio is attnlab's over torch's.
- Memory: the peak of the device allocator above what was held before the call, less the
  output, for one call; shown beside the size of the ``(B, H, L, S)`` float32 score matrix.
- The decoder: SmolLM2-135M's shape (30 blocks, 576 wide, 9 query and 3 key/value heads,
  a 49,152-token vocabulary) with transformers' random initialisation, float32, batch 1:
  prefill of ``--prompt`` tokens, and ``--new`` greedy tokens (decode rate from
  generating ``new`` and 1 token after the same prompt, so the prefill cancels).

    python benchmarks/gpu.py [--device cuda] [--repeat 10] [--prompt 512] [--new 64] [--quick]

``--device cpu`` runs the same comparisons on torch CPU tensors (a check of the script;
``--quick`` shrinks every shape). Needs torch, transformers and ``array-api-compat``; JAX
and CuPy rows run where they import. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
import traceback


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu checks the script)")
    p.add_argument("--repeat", type=int, default=10, help="timed calls of each, in turns (default 10)")
    p.add_argument("--prompt", type=int, default=512, help="the decoder's prompt tokens (default 512)")
    p.add_argument("--new", type=int, default=64, help="the decoder's new tokens (default 64)")
    p.add_argument("--quick", action="store_true", help="small shapes: a check that every section runs")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: sdpa,memory,mha,jax,cupy,model")
    return p.parse_args(argv)


class Clock:
    """Wall-clock timing with the device synchronised around each call."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, torch.device(device).type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def turns(self, fns: dict, *, repeat: int, warmup: int = 2) -> dict:
        """Median seconds of each function, called in turns after ``warmup`` calls each."""
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        self.sync()
        times = {k: [] for k in fns}
        for _ in range(repeat):
            for k, fn in fns.items():
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                times[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in times.items()}


def max_err(x, ref) -> float:
    return float((x.double() - ref).abs().max())


def sdpa_rows(torch, attnlab, clock, device, args) -> None:
    F = torch.nn.functional
    shapes = [  # (label, B, H_q, H_kv, L, E, causal)
        ("BERT-like", 32, 12, 12, 128, 32, False),
        ("mid", 8, 12, 12, 256, 64, False),
        ("SmolLM2-like GQA", 1, 9, 3, 512, 64, True),
        ("GPT-2-like", 1, 12, 12, 1024, 64, True),
        ("long", 1, 8, 8, 4096, 64, True),
        ("long", 1, 8, 8, 8192, 64, True),
    ]
    if args.quick:
        shapes = [(lab, min(b, 2), hq, hk, min(n, 256), e, c) for lab, b, hq, hk, n, e, c in shapes[:4]]
    print("\n## scaled_dot_product_attention: attnlab's time over torch's, errors against float64")
    print("| shape | dtype | attnlab ms | torch ms | ratio | attnlab max err | torch max err | err ratio |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device=device).manual_seed(0)
    for label, b, hq, hk, n, e, causal in shapes:
        q64 = torch.randn(b, hq, n, e, device=device, dtype=torch.float64, generator=g)
        k64 = torch.randn(b, hk, n, e, device=device, dtype=torch.float64, generator=g)
        v64 = torch.randn(b, hk, n, e, device=device, dtype=torch.float64, generator=g)
        gqa = hq != hk
        ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=gqa)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            q, k, v = q64.to(dtype), k64.to(dtype), v64.to(dtype)
            ours = functools.partial(attnlab.scaled_dot_product_attention, q, k, v, is_causal=causal,
                                     enable_gqa=gqa)
            theirs = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal, enable_gqa=gqa)
            t = clock.turns({"a": ours, "t": theirs}, repeat=args.repeat)
            ea, et = max_err(ours(), ref), max_err(theirs(), ref)
            print(f"| {label} B={b} H={hq}/{hk} L={n} E={e}{' causal' if causal else ''} | "
                  f"{str(dtype).split('.')[-1]} | {t['a'] * 1e3:.3f} | {t['t'] * 1e3:.3f} | "
                  f"{t['a'] / t['t']:.2f} | {ea:.2e} | {et:.2e} | {ea / et if et else math.nan:.2f} |")
        del q64, k64, v64, ref


def memory_rows(torch, attnlab, device, args) -> None:
    if torch.device(device).type != "cuda":
        print("\n(memory: CUDA only, skipped)")
        return
    F = torch.nn.functional
    b, h, n, e = 1, 8, (2048 if args.quick else 8192), 64
    scores = b * h * n * n * 4
    print(f"\n## Extra device memory of one call, B={b} H={h} L=S={n} E={e} causal "
          f"(the float32 score matrix: {scores / 2**20:.0f} MiB)")
    print("| dtype | attnlab MiB | % of scores | torch MiB | % of scores |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device=device).manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(b, h, n, e, device=device, dtype=dtype, generator=g) for _ in range(3))
        row = []
        for fn in (attnlab.scaled_dot_product_attention, F.scaled_dot_product_attention):
            fn(q, k, v, is_causal=True)  # warm: workspaces and caches made once
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn(q, k, v, is_causal=True)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
            row.append(max(extra, 0))
            del out
        print(f"| {str(dtype).split('.')[-1]} | {row[0] / 2**20:.1f} | {100 * row[0] / scores:.1f}% | "
              f"{row[1] / 2**20:.1f} | {100 * row[1] / scores:.1f}% |")


def mha_rows(torch, attnlab, clock, device, args) -> None:
    import numpy as np

    from attnlab.interop import to_torch

    b, n = (2, 64) if args.quick else (2, 512)
    ours = attnlab.MultiheadAttention(512, 8, batch_first=True, rng=np.random.default_rng(0)).eval()
    theirs = to_torch(ours).to(device).eval()
    ours.to(torch, device=device)
    x = torch.randn(b, n, 512, device=device, generator=torch.Generator(device=device).manual_seed(2))
    with torch.no_grad():
        a = lambda: ours(x, x, x, need_weights=False)[0]  # noqa: E731
        t_ = lambda: theirs(x, x, x, need_weights=False)[0]  # noqa: E731
        t = clock.turns({"a": a, "t": t_}, repeat=args.repeat)
        err = float((a() - t_()).abs().max())
    print(f"\n## MultiheadAttention(512, 8), B={b} L={n}, forward, float32")
    print(f"attnlab {t['a'] * 1e3:.3f} ms, torch {t['t'] * 1e3:.3f} ms: {t['a'] / t['t']:.2f}x torch's time; "
          f"largest difference {err:.1e}")


def jax_rows(attnlab, args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(3)
    n = 256 if args.quick else 1024
    q, k, v = (rng.standard_normal((1, 8, n, 64)) for _ in range(3))
    dev = jax.devices()[0]
    qj, kj, vj = (jax.device_put(jnp.asarray(a, dtype=jnp.float32), dev) for a in (q, k, v))
    out = np.asarray(attnlab.scaled_dot_product_attention(qj, kj, vj, is_causal=True), dtype=np.float64)
    ref = attnlab.scaled_dot_product_attention(q, k, v, is_causal=True)  # NumPy float64
    rel = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"\n## JAX float32 on {dev.platform} ({dev.device_kind}), B=1 H=8 L={n} causal: "
          f"largest error {rel:.1e} of the largest output (float64 NumPy reference)")


def cupy_rows(attnlab, clock, args) -> None:
    import cupy as cp
    import numpy as np

    rng = np.random.default_rng(4)
    n = 256 if args.quick else 1024
    q, k, v = (rng.standard_normal((1, 12, n, 64)) for _ in range(3))
    qc, kc, vc = (cp.asarray(a, dtype=cp.float32) for a in (q, k, v))
    fn = lambda: attnlab.scaled_dot_product_attention(qc, kc, vc, is_causal=True)  # noqa: E731
    t = clock.turns({"a": fn}, repeat=args.repeat)
    ref = attnlab.scaled_dot_product_attention(q, k, v, is_causal=True)
    rel = np.abs(cp.asnumpy(fn()).astype(np.float64) - ref).max() / np.abs(ref).max()
    print(f"\n## CuPy float32, B=1 H=12 L={n} causal: {t['a'] * 1e3:.3f} ms, largest error {rel:.1e} "
          f"of the largest output")


def model_rows(torch, attnlab, clock, device, args) -> None:
    import transformers

    from attnlab.interop import from_torch

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                 rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    if args.quick:
        shape.update(num_hidden_layers=2, vocab_size=1024)
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=None, **shape)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = from_torch(hf).eval().to(torch, device=device)
    hf.to(device)
    prompt, new = (32, 8) if args.quick else (args.prompt, args.new)
    ids = torch.randint(3, shape["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        a = lambda: ours(ids)  # noqa: E731
        t_ = lambda: hf(ids).logits  # noqa: E731
        t = clock.turns({"a": a, "t": t_}, repeat=max(3, args.repeat // 2))
        la, lt = a(), t_()
        err = float((la - lt).abs().max() / lt.abs().max())

        def gen_ours(k):
            return lambda: ours.generate(ids, k)

        def gen_theirs(k):
            return lambda: hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                       pad_token_id=0, eos_token_id=None)

        g = clock.turns({"a1": gen_ours(1), "aN": gen_ours(new), "t1": gen_theirs(1), "tN": gen_theirs(new)},
                        repeat=3, warmup=1)
        ta, tt = ours.generate(ids, new), hf.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                                      do_sample=False, pad_token_id=0, eos_token_id=None)
        same = int((ta[0, prompt:].cpu() == tt[0, prompt:].cpu()).cumprod(0).sum())
    rate_a = (new - 1) / (g["aN"] - g["a1"])
    rate_t = (new - 1) / (g["tN"] - g["t1"])
    print(f"\n## SmolLM2-shaped decoder ({shape['num_hidden_layers']} blocks, random weights), float32, batch 1")
    print(f"prefill {prompt} tokens: attnlab {t['a'] * 1e3:.2f} ms, transformers {t['t'] * 1e3:.2f} ms: "
          f"{t['a'] / t['t']:.2f}x its time; logits within {err:.1e} of the largest")
    print(f"decode: attnlab {rate_a:.1f} tokens/s, transformers {rate_t:.1f}: {rate_a / rate_t:.2f}x its rate; "
          f"first {same} of {new} greedy tokens the same")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import attnlab

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    for name, value, least in (("--repeat", args.repeat, 1), ("--prompt", args.prompt, 1), ("--new", args.new, 2)):
        if value < least:
            print(f"gpu.py: {name} must be at least {least}, got {value}", file=sys.stderr)
            return 2
    unknown = skip - {"sdpa", "memory", "mha", "jax", "cupy", "model"}
    if unknown:
        print(f"gpu.py: --skip names no section {sorted(unknown)}: sdpa, memory, mha, jax, cupy, model",
              file=sys.stderr)
        return 2
    device = args.device
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        print(f"gpu.py: torch cannot use device {device!r} here ({str(exc).splitlines()[0]}); "
              "--device cpu checks the script", file=sys.stderr)
        return 2
    clock = Clock(torch, device)
    print("# attnlab on", device)
    from attnlab._cpu import cpu_info

    print(f"CPU: {cpu_info().describe()}, {len(os.sched_getaffinity(0))} CPUs")
    if torch.device(device).type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}, "
              f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB")
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, attnlab {attnlab.__version__}")
    sections = [
        ("sdpa", lambda: sdpa_rows(torch, attnlab, clock, device, args)),
        ("memory", lambda: memory_rows(torch, attnlab, device, args)),
        ("mha", lambda: mha_rows(torch, attnlab, clock, device, args)),
        ("jax", lambda: jax_rows(attnlab, args)),
        ("cupy", lambda: cupy_rows(attnlab, clock, args)),
        ("model", lambda: model_rows(torch, attnlab, clock, device, args)),
    ]
    failed = 0
    for name, run in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            run()
        except ImportError as exc:
            print(f"\n({name}: skipped, {exc})")
        except Exception:  # one section's failure must not lose the others' figures
            failed += 1
            print(f"\n({name}: failed)")
            traceback.print_exc(file=sys.stdout)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
