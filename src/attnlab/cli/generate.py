"""attnlab generate --checkpoint PATH PROMPT: continue a sequence with a causal model.

PATH is a checkpoint written by `attnlab train` (a model trained on associative recall:
PROMPT is space-separated task tokens such as "k1 v5 k2 v9 k1", and a trained model
answers a repeated key with the value that followed it; only that answer was trained, so
what follows it is the model's guess), or a GPT-2 folder (config.json,
model.safetensors and, for text, tokenizer.json; without it PROMPT is space-separated
token ids). The prompt runs once and fills a key/value cache; each new token then costs
one step. Greedy by default (the likeliest token each step); --temperature above 0 samples,
--top-k keeps only the k likeliest tokens, --seed makes sampling repeatable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.cli._common import CLIError

DEFAULT_NEW_TOKENS = 8

# library argument names -> the flags a user typed
_FLAGS = (("max_new_tokens=", "--max-new-tokens "), ("max_new_tokens", "--max-new-tokens"),
          ("top_k=", "--top-k "), ("top_k", "--top-k"), ("temperature=", "--temperature "),
          ("temperature", "--temperature"), ("input_ids", "PROMPT"))


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a sequence with a trained recall model or a GPT-2 folder (key/value cache)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        '  attnlab generate --checkpoint attnlab-out/train/checkpoint.npz "k1 v5 k2 v9 k1"\n'
        '  attnlab generate --checkpoint gpt2-folder "The cat sat" --max-new-tokens 20 '
        "--temperature 0.8 --top-k 40 --seed 1",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the sequence to continue (quote it)")
    p.add_argument("--checkpoint", metavar="PATH", required=True,
                   help="a checkpoint file from attnlab train, or a GPT-2 checkpoint folder")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to add (default {DEFAULT_NEW_TOKENS}, or as many as the model's "
                   "context still holds)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="X",
                   help="0 (default): greedy; above 0: sample from softmax(logits / X)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample only among the K likeliest tokens (needs --temperature above 0)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling (default 0)")
    p.set_defaults(run=run)


def _flags(msg: str) -> str:
    for name, flag in _FLAGS:
        msg = msg.replace(name, flag)
    return msg


def _new_tokens(args, prompt_length: int, limit: int, limit_name: str) -> int:
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 0:
            raise CLIError(f"--max-new-tokens must be a non-negative integer, got {args.max_new_tokens}")
        return args.max_new_tokens
    room = limit - prompt_length
    if room < 1:
        raise CLIError(f"the prompt has {prompt_length} tokens: the model's {limit_name}={limit} leaves "
                       "no room for new ones")
    return min(DEFAULT_NEW_TOKENS, room)


def _recall(args, path: Path, sampling: dict) -> tuple[str, str, str]:
    from attnlab.train.checkpoint import load_checkpoint

    model, task, _meta = load_checkpoint(path)
    c = model.config
    ids = task.encode(args.prompt)
    n = _new_tokens(args, len(ids), c.context_length, "context_length")
    out = model.generate(ids, n, **sampling)
    desc = (f"TinyTransformer ({c.n_layers} layers, {c.n_heads} heads, d_model {c.d_model}) trained on "
            f"associative recall: {path.name}")
    return desc, task.decode(out[len(ids) :]), task.decode(out)


def _gpt2(args, path: Path, sampling: dict) -> tuple[str, str, str]:
    import numpy as np

    from attnlab.models.gpt2 import GPT2

    model = GPT2.from_pretrained(path)
    c = model.config
    desc = f"GPT-2 ({c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}): {path.name}"
    if model.tokenizer is not None:
        ids, _ = model.encode(args.prompt)
        n = _new_tokens(args, len(ids), c.n_positions, "n_positions")
        text = model.generate_text(args.prompt, n, **sampling)
        return desc, text[len(args.prompt) :] if text.startswith(args.prompt) else text, text
    words = args.prompt.split()
    if not all(w.isdigit() for w in words):
        raise CLIError(f"{path} has no tokenizer.json: give PROMPT as space-separated token ids in "
                       f"0..{c.vocab_size - 1}, e.g. \"1 2 3\"")
    ids = np.array([int(w) for w in words], dtype=np.int64)
    n = _new_tokens(args, len(ids), c.n_positions, "n_positions")
    out = model.generate(ids, n, **sampling)
    return desc, " ".join(map(str, out[len(ids) :])), " ".join(map(str, out))


def run(args) -> int:
    import numpy as np

    if not args.prompt.strip():
        raise CLIError('PROMPT is empty: give a sequence to continue, e.g. "k1 v5 k2 v9 k1"')
    if args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer, got {args.seed}")
    path = Path(args.checkpoint)
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "rng": np.random.default_rng(args.seed)}
    try:
        from attnlab.models.registry import detect

        family = detect(path)
        if not family.decoder:
            raise CLIError(f"{path} holds a {family.name} model, which is an encoder: it cannot generate")
        desc, new, whole = (_recall if family.name == "tiny" else _gpt2)(args, path, sampling)
    except FileNotFoundError as exc:
        raise CLIError(f"file not found: {exc.filename}" if exc.filename else str(exc)) from None
    except ImportError as exc:
        raise CLIError(f"cannot read {path}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CLIError(_flags(str(exc))) from None
    except OSError as exc:
        raise CLIError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
    how = "greedy (the likeliest token each step)" if args.temperature == 0 else (
        f"sampled at temperature {args.temperature:g}" + (f" among the {args.top_k} likeliest" if args.top_k else "")
        + f", seed {args.seed}")
    print(f"model      {desc}")
    print(f"prompt     {args.prompt}")
    print(f"generated  {new}")
    print(f"sequence   {whole}")
    print(f"decoding   {how}, with a key/value cache")
    return 0
