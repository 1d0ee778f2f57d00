"""attnlab demo: "The cat sat on the mat" through a model, as tables and pictures.

Prints the tokens, the shapes and one head's attention weights as a table, and writes
heatmap.png, heads.png and embeddings.png (the static-vs-contextual view) to DIR (default
./attnlab-out). Uses the pretrained MiniLM model when it is installed, else a small
attention layer with random weights (embed_dim 128, 4 heads; --model random picks it
explicitly); --model smollm2 runs the bundled decoder (SmolLM2-135M-Instruct). For a model
file or folder, use attnlab explain --checkpoint PATH.
"""

from __future__ import annotations

import argparse

DEMO_TEXT = "The cat sat on the mat"
DEFAULT_OUT = "attnlab-out"


def register(sub) -> None:
    from attnlab.cli.explain import add_model_options

    p = sub.add_parser(
        "demo",
        help="run the example sentence and draw its pictures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p, paths=False)  # demo reads no file: the models that need none
    p.set_defaults(run=run, out=None)
    for action in p._actions:
        if action.dest == "out":
            action.help = f"write the pictures to DIR (default ./{DEFAULT_OUT})"


def run(args) -> int:
    from attnlab.cli.explain import explain_command

    out = args.out if args.out is not None else DEFAULT_OUT
    return explain_command(DEMO_TEXT, args, out_dir=out)
