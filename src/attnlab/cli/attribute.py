"""attnlab attribute TEXT --target TOKEN: which tokens of TEXT made the model produce TOKEN.

Prints the prompt's tokens coloured by their score (red: pushes towards the target, blue:
away; plain text with the scores when the output is not a terminal or NO_COLOR is set).
Decoders (--model smollm2, the default, or gpt2/checkpoint with --checkpoint PATH): the
scalar is the log-probability of TOKEN at the last position (--output logit or prob for
the others); a TOKEN of several tokens is a generated continuation, one row per token (each
attributed to the prompt and the continuation before it). --model minilm: the cosine
similarity of TEXT's sentence vector with TOKEN's (a text). Without --target the model's
own prediction is attributed.

A token's score is the sum over its embedding's dimensions of the attribution (the L2
norm of the gradient for --method saliency); integrated gradients' scores add up to the
change of the scalar from the baseline to the text, up to the completeness gap printed.
"""

from __future__ import annotations

import argparse
import json
import sys

from attnlab.cli._common import CLIError, use_color

MODELS = ("smollm2", "gpt2", "checkpoint", "minilm")


def register(sub) -> None:
    p = sub.add_parser(
        "attribute",
        help="which input tokens made the model produce a token (saliency, integrated gradients)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  attnlab attribute \"The capital of France is\" --target \" Paris\"\n"
        "  attnlab attribute \"When Mary and John went to the store, John gave a drink to\" --method saliency\n"
        "  attnlab attribute \"The bank of the river\" --model minilm --target \"a river's edge\"",
    )
    p.add_argument("text", metavar="TEXT", help="the prompt (quote it)")
    p.add_argument("--target", metavar="TOKEN", default=None,
                   help="what to attribute: the next token (its text, e.g. \" Paris\" with its leading space); "
                   "several tokens are a continuation, one row each (default: the model's prediction); "
                   "--model minilm: a text to compare with")
    p.add_argument("--model", choices=MODELS, default="smollm2",
                   help="smollm2 (bundled, default), gpt2 or checkpoint (a decoder folder or .gguf file: "
                   "--checkpoint PATH), minilm (sentence vectors)")
    p.add_argument("--checkpoint", metavar="PATH", default=None, help="the model folder or file for --model gpt2")
    p.add_argument("--method", choices=("integrated_gradients", "saliency", "input_x_gradient"),
                   default="integrated_gradients", help="default: integrated_gradients")
    p.add_argument("--steps", type=int, default=50, help="integrated gradients' points (default 50)")
    p.add_argument("--rule", default="gausslegendre",
                   choices=("gausslegendre", "riemann_right", "riemann_left", "riemann_middle", "riemann_trapezoid"),
                   help="integration rule (default gausslegendre)")
    p.add_argument("--baseline", choices=("zeros", "pad"), default=None,
                   help="integrated gradients' baseline (default: zeros for models with position embeddings, "
                   "pad for rotary ones, where a zero residual is singular for RMSNorm)")
    p.add_argument("--output", choices=("log_prob", "logit", "prob"), default="log_prob",
                   help="the decoder's scalar (default log_prob)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="coloured tokens (default) or one JSON document")
    p.set_defaults(run=run)


# ---- colour -------------------------------------------------------------------------------
# 256-colour backgrounds from white to red (positive) and to blue (negative), 5 steps each.
_RED = (231, 224, 217, 210, 203, 196)
_BLUE = (231, 189, 153, 117, 75, 33)


def _shade(score: float, top: float) -> int:
    level = min(5, int(round(5 * abs(score) / top))) if top > 0 else 0
    return (_RED if score >= 0 else _BLUE)[level]


def format_tokens(tokens: list[str], scores, *, color: bool) -> str:
    """The tokens coloured by score (ANSI backgrounds, black text), or, without colour, one
    ``token  score  bar`` line each.

    >>> print(format_tokens(["The", " cat"], [0.5, -1.0], color=False))
      'The'    +0.500  +++++
      ' cat'   -1.000  ----------
    """
    import numpy as np

    scores = np.asarray(scores, np.float64)
    top = float(np.abs(scores).max()) if scores.size else 0.0
    shown = [t.replace("Ġ", " ").replace("Ċ", "\\n") for t in tokens]
    if color:
        parts = [f"\x1b[48;5;{_shade(s, top)}m\x1b[38;5;16m{t}\x1b[0m" for t, s in zip(shown, scores, strict=True)]
        return "".join(parts)
    width = max((len(repr(t)) for t in shown), default=0)
    lines = []
    for t, s in zip(shown, scores, strict=True):
        bar = ("+" if s >= 0 else "-") * (int(round(10 * abs(s) / top)) if top > 0 else 0)
        lines.append(f"  {repr(t).ljust(width)}  {s:+.3f}  {bar}")
    return "\n".join(lines)


def legend(color: bool) -> str:
    if not color:
        return "  (score: + pushes towards the target, - away; bars scaled to the largest)"
    return ("  colour: " + f"\x1b[48;5;{_RED[5]}m\x1b[38;5;16m towards \x1b[0m "
            + f"\x1b[48;5;{_BLUE[5]}m\x1b[38;5;16m away \x1b[0m (scaled to the largest score)")


# ---- the command --------------------------------------------------------------------------
def _load(args):
    try:
        if args.model == "smollm2":
            from attnlab.models import load_smollm2

            return load_smollm2()
        if args.model == "minilm":
            from attnlab.models import load_minilm

            return load_minilm()
        if args.checkpoint is None:
            raise CLIError(f"--model {args.model} needs --checkpoint PATH (a decoder folder or .gguf file)")
        from attnlab.models import from_pretrained

        return from_pretrained(args.checkpoint)
    except ImportError:
        from attnlab.cli.explain import _not_available

        raise CLIError(_not_available(args.model)) from None
    except FileNotFoundError as exc:
        raise CLIError(f"file not found: {exc.filename or exc}") from None
    except (ValueError, OSError) as exc:
        raise CLIError(str(exc)) from None


def run(args) -> int:
    import numpy as np

    from attnlab.inspect import input_attribution

    if not args.text.strip():
        raise CLIError("TEXT is empty: give a prompt, e.g. \"The capital of France is\"")
    if args.steps < 1:
        raise CLIError(f"--steps must be >= 1, got {args.steps}")
    model = _load(args)
    encoder = args.model == "minilm"
    try:
        if encoder:
            if args.target is None:
                raise CLIError("--model minilm needs --target TEXT: the text whose sentence vector to compare with")
            enc, ids, _ = model._one_text(args.text)
            tokens, target, what = list(enc.tokens), args.target, [f"cosine similarity with {args.target!r}"]
            ids = ids[0]
        else:
            ids, tokens = model.encode(args.text)
            if args.target is None:
                target = int(model(ids[None], logits_to_keep=1)[0, -1].argmax())
                pieces = [model.tokenizer.decode([target])]
            else:
                target, pieces = model.encode(args.target)
                target = [int(t) for t in target]
                pieces = [model.tokenizer.decode([t]) for t in target]
                if len(target) == 1:
                    target = target[0]
            what = [f"{args.output} of {p!r}" for p in pieces]
        result = input_attribution(model, ids, target, method=args.method, steps=args.steps, rule=args.rule,
                                   baseline=args.baseline, output=args.output)
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None
    rows = np.atleast_2d(result.scores)
    values = np.atleast_1d(result.value)
    gaps = None if result.gap is None else np.atleast_1d(result.gap)
    changes = None if result.baseline_value is None else values - np.atleast_1d(result.baseline_value)
    if args.format == "json":
        doc = {"text": args.text, "tokens": list(tokens), "method": result.method, "rule": result.rule,
               "steps": result.steps, "output": result.output,
               "rows": [{"target": w, "scores": [round(float(v), 6) for v in row[: len(tokens) + k]],
                         "value": float(values[k]),
                         "gap": None if gaps is None else float(gaps[k])}
                        for k, (w, row) in enumerate(zip(what, rows, strict=True))]}
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        return 0
    color = use_color(sys.stdout)
    fed = list(tokens)
    if not encoder and rows.shape[0] > 1:
        fed += [model.tokenizer.id_to_token(int(t)) or str(t) for t in np.atleast_1d(target)[:-1]]
    how = result.method.replace("_", " ") + (f" ({result.steps} {result.rule} points)" if result.rule else "")
    print(f"{how}; a token's score sums its embedding's dimensions"
          + (" (saliency: the gradient's norm)" if result.method == "saliency" else ""))
    for k, w in enumerate(what):
        n = len(tokens) + k if rows.shape[0] > 1 else len(tokens)
        print(f"\n{w}: {values[k]:+.4f}")
        print(format_tokens(fed[:n], rows[k, :n], color=color))
        if gaps is not None:
            share = abs(gaps[k]) / abs(changes[k]) if changes[k] else float("nan")
            print(f"  scores sum {rows[k].sum():+.4f}; change from the baseline {changes[k]:+.4f}; "
                  f"completeness gap {gaps[k]:+.4f} ({share:.1%})")
    print(legend(color))
    return 0
