"""attnlab generate [--checkpoint PATH] PROMPT: continue a text with a causal language model.

Without --checkpoint the bundled SmolLM2-135M-Instruct answers (installed by `make demo`:
30 blocks, 9 query heads over 3 key/value heads, rotary positions): PROMPT is the user's
message, put through the model's chat template (--raw continues the text as it is).
PATH is any decoder attnlab runs: a Hugging Face folder (GPT-2, Llama, Mistral, Qwen2,
Qwen3: config.json, model.safetensors and, for text, tokenizer.json; without it PROMPT is
space-separated token ids), a .gguf file, or a checkpoint written by `attnlab train` (a
model trained on associative recall: PROMPT is task tokens such as "k1 v5 k2 v9 k1").
PROMPT - reads the prompt from standard input, --file PATH from a file.

The prompt runs once and fills a key/value cache; each new token then costs one step, and
is printed as soon as it is made. Ctrl-C stops: what was generated stays on the screen
(exit status 130). Greedy by default (the likeliest token each step); --temperature above
0 samples, --top-k keeps only the k likeliest tokens, --seed makes sampling repeatable.
--cache-dtype float16 halves the cache's memory (llama.cpp's default cache type); int8
keeps a code a value and a scale a token and head (about a quarter of float32's memory).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnlab.cli._common import CLIError, add_quantized_flags, check_quantized_flags, load_decoder

#: New tokens of a raw continuation (and of a recall checkpoint) when --max-new-tokens is not given.
DEFAULT_NEW_TOKENS = 8
#: An answer through a chat template ends at the model's end token; this bounds it.
DEFAULT_CHAT_TOKENS = 64
#: The prompt is echoed on one line, cut to this many characters.
ECHO_CHARS = 100

# library argument names -> the flags a user typed
_FLAGS = (("max_new_tokens=", "--max-new-tokens "), ("max_new_tokens", "--max-new-tokens"),
          ("top_k=", "--top-k "), ("top_k", "--top-k"), ("temperature=", "--temperature "),
          ("temperature", "--temperature"), ("input_ids", "PROMPT"))


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a text with SmolLM2, any decoder folder or .gguf file, or a recall model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        '  attnlab generate "What is the capital of France?"\n'
        '  attnlab generate --raw "The capital of France is"\n'
        "  attnlab generate --file question.txt\n"
        '  echo "Tell me a story" | attnlab generate - --max-new-tokens 200\n'
        '  attnlab generate --checkpoint attnlab-out/train/checkpoint.npz "k1 v5 k2 v9 k1"\n'
        '  attnlab generate --checkpoint gpt2-folder "The cat sat" --max-new-tokens 20 '
        "--temperature 0.8 --top-k 40 --seed 1",
    )
    p.add_argument("prompt", metavar="PROMPT", nargs="?", default=None,
                   help="the text to continue (quote it); - reads it from standard input")
    p.add_argument("--file", metavar="PATH", default=None,
                   help="read the prompt from the file PATH (UTF-8) instead of PROMPT")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="a decoder folder, a .gguf file or a checkpoint from attnlab train (default: the "
                   "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true",
                   help="continue PROMPT as it is, without the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to add, at most (default: {DEFAULT_CHAT_TOKENS} for an answer through a chat "
                   f"template, which usually ends sooner, at the model's end token; {DEFAULT_NEW_TOKENS} "
                   "otherwise; never more than the model's context still holds); 0: none")
    p.add_argument("--temperature", type=float, default=0.0, metavar="X",
                   help="0 (default): greedy; above 0: sample from softmax(logits / X)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample only among the K likeliest tokens (needs --temperature above 0)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling (default 0)")
    p.add_argument("--adapter", metavar="FOLDER", default=None,
                   help="a LoRA adapter (adapter_config.json + adapter_model.safetensors, from attnlab finetune "
                   "or PEFT) for the model, applied before generating")
    add_quantized_flags(p, what="--checkpoint")
    p.add_argument("--cache-dtype", choices=("float32", "float16", "int8"), default=None,
                   help="the key/value cache's storage: float16 takes half the memory and, with --quantized, "
                   "makes long generations faster (each new token reads half the bytes of the cache); its keys "
                   "and values are rounded to float16. int8: about a quarter of the memory, each token's head "
                   "stored as int8 codes and a scale (each value within 1/254 of its head's largest); faster "
                   "still after a few thousand tokens (default: the model's own dtype)")
    p.set_defaults(run=run)


def _flags(msg: str) -> str:
    for name, flag in _FLAGS:
        msg = msg.replace(name, flag)
    return msg


@dataclass
class _Run:
    """What to print before the answer, and the answer's pieces (made lazily)."""

    desc: str
    pieces: Iterator[str]
    prompt_tokens: int
    new_tokens: int
    counter: list


def _counted(tokens, counter: list, eos=None):
    """``tokens``, counting in ``counter[0]`` those that are not an end token ``eos``."""
    import numpy as np

    stop = set(np.atleast_1d(eos).tolist()) if eos is not None else set()
    for t in tokens:
        counter[0] += int(t) not in stop
        yield t


def _spaced(words):
    """``words`` as pieces of one space-separated line."""
    for i, w in enumerate(words):
        yield w if i == 0 else " " + w


def _new_tokens(args, prompt_length: int, limit: int, limit_name: str, default: int) -> int:
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 0:
            raise CLIError(f"--max-new-tokens must be a non-negative integer, got {args.max_new_tokens}")
        return args.max_new_tokens
    room = limit - prompt_length
    if room < 1:
        raise CLIError(f"the prompt has {prompt_length} tokens: the model's {limit_name}={limit} leaves "
                       "no room for new ones")
    return min(default, room)


def _recall(args, prompt: str, path: Path, sampling: dict) -> _Run:
    from attnlab.train.checkpoint import load_checkpoint

    model, task, _meta = load_checkpoint(path)
    c = model.config
    ids = task.encode(prompt)
    n = _new_tokens(args, len(ids), c.context_length, "context_length", DEFAULT_NEW_TOKENS)
    counter = [0]
    tokens = _counted(model.stream(ids, n, cache_dtype=args.cache_dtype, **sampling), counter)
    desc = (f"TinyTransformer ({c.n_layers} layers, {c.n_heads} heads, d_model {c.d_model}) trained on "
            f"associative recall: {path.name}")
    return _Run(desc, _spaced(task.decode([t]) for t in tokens), len(ids), n, counter)


def _describe(model, path: Path | None) -> str:
    layers = model.layers
    attn = layers[0].attn
    heads = f"{attn.num_heads} heads"
    if attn.num_kv_heads != attn.num_heads:
        heads = f"{attn.num_heads} query heads over {attn.num_kv_heads} key/value heads"
    where = f": {path.name}" if path is not None else ""
    return f"{model.name} ({len(layers)} blocks, {heads}, width {attn.embed_dim}){where}"


def _decoder(args, prompt: str, path: Path | None, sampling: dict) -> _Run:
    import numpy as np

    from attnlab.models.decoder import decode_stream

    model = load_decoder(path, quantized=args.quantized, activations=args.activations)
    if args.adapter is not None:  # merged into float weights; beside quantized ones
        from attnlab.train.lora import load_adapter

        load_adapter(model, args.adapter, merge=not args.quantized)
    desc = _describe(model, path)
    limit = model.max_positions
    counter = [0]
    if model.tokenizer is None:
        words = prompt.split()
        if not all(w.isdigit() for w in words):
            raise CLIError(f"{path} has no tokenizer: give PROMPT as space-separated token ids in "
                           f"0..{model.config.vocab_size - 1}, e.g. \"1 2 3\"")
        ids = np.array([int(w) for w in words], dtype=np.int64)
        n = _new_tokens(args, len(ids), limit, "context length", DEFAULT_NEW_TOKENS)
        tokens = _counted(model.stream(ids, n, cache_dtype=args.cache_dtype, **sampling), counter)
        return _Run(desc, _spaced(str(t) for t in tokens), len(ids), n, counter)
    chat = getattr(model, "chat_template", None) is not None and not args.raw
    ids, _ = model.encode(model.chat_prompt(prompt) if chat else prompt)
    n = _new_tokens(args, len(ids), limit, "context length", DEFAULT_CHAT_TOKENS if chat else DEFAULT_NEW_TOKENS)
    if chat:
        desc += ", through its chat template"
    eos = model.config.eos_token_id
    tokens = _counted(model.stream(ids, n, eos_token_id=eos, cache_dtype=args.cache_dtype, **sampling), counter, eos)
    pieces = decode_stream(model.tokenizer, tokens, context=[] if chat else ids[-8:].tolist(), eos_token_id=eos,
                           skip_special_tokens=chat)
    return _Run(desc, pieces, len(ids), n, counter)


def echo(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` on one line for the echo: line breaks and tabs as ``\\n`` and ``\\t``; a
    longer text cut, with its size said.

    >>> echo("What is\\nthis?")
    'What is\\\\nthis?'
    >>> echo("word " * 1000, limit=20)
    'word word word word … (5,000 characters, 1,000 words)'
    """
    one_line = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    if len(one_line) <= limit:
        return one_line
    return f"{one_line[:limit].rstrip()} … ({len(text):,} characters, {len(text.split()):,} words)"


def run(args) -> int:
    import numpy as np

    from attnlab.cli.explain import read_text

    prompt = read_text(args, name="prompt")
    if args.prompt is None or args.prompt == "-":  # a file's or a pipe's last line break ends the text, not the prompt
        prompt = prompt.removesuffix("\n").removesuffix("\r")
    if not prompt.strip():
        hint = "k1 v5 k2 v9 k1" if args.checkpoint and Path(args.checkpoint).suffix == ".npz" else \
            "What is the capital of France?"
        raise CLIError(f'PROMPT is empty: give a text to continue, e.g. "{hint}"')
    if args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer, got {args.seed}")
    path = None if args.checkpoint is None else Path(args.checkpoint)
    check_quantized_flags(args, path, what="--checkpoint")
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "rng": np.random.default_rng(args.seed)}
    try:
        family = None
        if path is not None:
            from attnlab.models.registry import detect

            family = detect(path)
            if not family.decoder:
                raise CLIError(f"{path} holds a {family.name} model, which is an encoder: it cannot generate")
        if family is not None and family.name == "tiny":
            if args.adapter is not None:
                raise CLIError("--adapter applies to a transformers decoder or .gguf file, not to a recall checkpoint")
            gen = _recall(args, prompt, path, sampling)
        else:
            gen = _decoder(args, prompt, path, sampling)
    except FileNotFoundError as exc:
        raise CLIError(f"file not found: {exc.filename}" if exc.filename else str(exc)) from None
    except ImportError as exc:
        raise CLIError(f"cannot read {path or 'the bundled SmolLM2'}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CLIError(_flags(str(exc))) from None
    except MemoryError:
        raise CLIError("not enough memory for this model and prompt; use a smaller model or "
                       "--max-new-tokens") from None
    except OSError as exc:
        raise CLIError(f"cannot read {exc.filename or path}: {exc.strerror or exc}") from None
    how = "greedy (the likeliest token each step)" if args.temperature == 0 else (
        f"sampled at temperature {args.temperature:g}" + (f" among the {args.top_k} likeliest" if args.top_k else "")
        + f", seed {args.seed}")
    print(f"model      {gen.desc}")
    print(f"prompt     {echo(prompt)}")
    weights = ""
    if args.quantized:
        from attnlab.quant import keeps_quantized

        weights = (", quantized weights" + (" with int8 activations" if args.activations == "int8" else "")
                   if keeps_quantized() else ", float32 weights (numba missing: dequantized)")
    cache = "a key/value cache" if args.cache_dtype is None else \
        f"{'an' if args.cache_dtype == 'int8' else 'a'} {args.cache_dtype} key/value cache"
    print(f"decoding   {how}, with {cache}{weights}"
          + f"; at most {gen.new_tokens} new token{'s' if gen.new_tokens != 1 else ''}")
    if gen.new_tokens == 0:
        print("generated  (nothing: --max-new-tokens 0)")
        return 0
    print("generated  ", end="", flush=True)
    start = time.perf_counter()
    first = None
    try:
        for piece in gen.pieces:
            if first is None:
                first = time.perf_counter() - start
            print(piece.replace("\n", "\n           "), end="", flush=True)
    except KeyboardInterrupt:
        print(flush=True)
        n = gen.counter[0]
        print(f"attnlab generate: interrupted after {n} new token{'s' if n != 1 else ''}; the text above is what "
              "was generated", file=sys.stderr, flush=True)
        return 130
    except (ValueError, MemoryError) as exc:
        print(flush=True)
        raise CLIError(_flags(str(exc)) if isinstance(exc, ValueError) else "not enough memory to go on") from None
    took = time.perf_counter() - start
    print()
    n = gen.counter[0]
    rate = f", then {(n - 1) / (took - first):.1f} tokens/s" if first is not None and n > 1 and took > first else ""
    when = f"the first after {first:.2f} s (the prompt's {gen.prompt_tokens} tokens)" if first is not None else ""
    print(f"time       {n} new token{'s' if n != 1 else ''} in {took:.2f} s" + (f": {when}{rate}" if when else ""))
    return 0
