"""``attnlab demo``: seed 000's run on "The cat sat on the mat" (placeholder until the text
pipeline lands: prints the core example)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the tutorial example", description=__doc__)
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=run)


def run(args) -> int:
    import numpy as np

    import attnlab

    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    context, weights = attnlab.simple_attention(x)
    print(f"x {x.shape} -> context {context.shape}, weights {weights.shape}")
    print(np.array2string(weights, precision=2))
    return 0
