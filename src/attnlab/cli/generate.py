"""attnlab generate [--checkpoint PATH] PROMPT: continue a text with a causal language model.

Without --checkpoint the bundled SmolLM2-135M-Instruct answers (installed by `make demo`:
30 blocks, 9 query heads over 3 key/value heads, rotary positions): PROMPT is the user's
message, put through the model's chat template (--raw continues the text as it is).
PATH is any decoder attnlab runs: a Hugging Face folder (GPT-2, Llama, Mistral, Qwen2,
Qwen3: config.json, model.safetensors and, for text, tokenizer.json; without it PROMPT is
space-separated token ids), a .gguf file, or a checkpoint written by `attnlab train` (a
model trained on associative recall: PROMPT is task tokens such as "k1 v5 k2 v9 k1"). The
prompt runs once and fills a key/value cache; each new token then costs one step. Greedy
by default (the likeliest token each step); --temperature above 0 samples, --top-k keeps
only the k likeliest tokens, --seed makes sampling repeatable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.cli._common import CLIError

DEFAULT_NEW_TOKENS = 8
#: An answer through a chat template ends at the model's end token; this bounds it.
DEFAULT_CHAT_TOKENS = 64

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
        '  attnlab generate --checkpoint attnlab-out/train/checkpoint.npz "k1 v5 k2 v9 k1"\n'
        '  attnlab generate --checkpoint gpt2-folder "The cat sat" --max-new-tokens 20 '
        "--temperature 0.8 --top-k 40 --seed 1",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the sequence to continue (quote it)")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="a decoder folder, a .gguf file or a checkpoint from attnlab train (default: the "
                   "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true",
                   help="continue PROMPT as it is, without the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to add (default {DEFAULT_NEW_TOKENS}, or as many as the model's "
                   "context still holds)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="X",
                   help="0 (default): greedy; above 0: sample from softmax(logits / X)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample only among the K likeliest tokens (needs --temperature above 0)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the sampling (default 0)")
    p.add_argument("--adapter", metavar="FOLDER", default=None,
                   help="a LoRA adapter (adapter_config.json + adapter_model.safetensors, from attnlab finetune "
                   "or PEFT) for the model, applied before generating")
    p.add_argument("--quantized", action="store_true",
                   help="keep a .gguf file's Q8_0/Q4_0/Q4_1 weights quantized (the bundled SmolLM2 too): "
                   "about 5x fewer bytes read per token, faster decoding, logits within about 1e-2 of "
                   "the float32 default")
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


def _describe(model, path: Path | None) -> str:
    layers = model.layers
    attn = layers[0].attn
    heads = f"{attn.num_heads} heads"
    if attn.num_kv_heads != attn.num_heads:
        heads = f"{attn.num_heads} query heads over {attn.num_kv_heads} key/value heads"
    where = f": {path.name}" if path is not None else ""
    return f"{model.name} ({len(layers)} blocks, {heads}, width {attn.embed_dim}){where}"


def _decoder(args, path: Path | None, sampling: dict) -> tuple[str, str, str]:
    import numpy as np

    if path is None:
        from attnlab.models.llama import load_smollm2

        model = load_smollm2(quantized=args.quantized)
    else:
        from attnlab.models.registry import from_pretrained

        model = from_pretrained(path, **({"quantized": True} if args.quantized else {}))
    if args.adapter is not None:  # merged into float weights; beside quantized ones
        from attnlab.train.lora import load_adapter

        load_adapter(model, args.adapter, merge=not args.quantized)
    desc = _describe(model, path)
    limit = model.max_positions
    chat = getattr(model, "chat_template", None) is not None and not args.raw
    if model.tokenizer is not None:
        if chat:
            ids, _ = model.encode(model.chat_prompt(args.prompt))
            n = args.max_new_tokens if args.max_new_tokens is not None else DEFAULT_CHAT_TOKENS
            n = _new_tokens(argparse.Namespace(max_new_tokens=min(n, max(limit - len(ids), 0)) or None), len(ids),
                            limit, "context length")
            answer = model.generate_text(args.prompt, n, chat=True, **sampling)
            return desc + ", through its chat template", answer, answer
        ids, _ = model.encode(args.prompt)
        n = _new_tokens(args, len(ids), limit, "context length")
        options = {"chat": False} if getattr(model, "chat_template", None) is not None else {}
        text = model.generate_text(args.prompt, n, **options, **sampling)
        return desc, text[len(args.prompt) :] if text.startswith(args.prompt) else text, text
    words = args.prompt.split()
    if not all(w.isdigit() for w in words):
        raise CLIError(f"{path} has no tokenizer: give PROMPT as space-separated token ids in "
                       f"0..{model.config.vocab_size - 1}, e.g. \"1 2 3\"")
    ids = np.array([int(w) for w in words], dtype=np.int64)
    n = _new_tokens(args, len(ids), limit, "context length")
    out = model.generate(ids, n, **sampling)
    return desc, " ".join(map(str, out[len(ids) :])), " ".join(map(str, out))


def run(args) -> int:
    import numpy as np

    if not args.prompt.strip():
        raise CLIError('PROMPT is empty: give a sequence to continue, e.g. "k1 v5 k2 v9 k1"')
    if args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer, got {args.seed}")
    path = None if args.checkpoint is None else Path(args.checkpoint)
    if args.quantized and path is not None and path.suffix.lower() != ".gguf":
        raise CLIError(f"--quantized needs a .gguf file (or no --checkpoint: the bundled SmolLM2), got {path}")
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
            desc, new, whole = _recall(args, path, sampling)
        else:
            desc, new, whole = _decoder(args, path, sampling)
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
    print(f"model      {desc}")
    print(f"prompt     {args.prompt}")
    print(f"generated  {new}")
    print(f"sequence   {whole}")
    print(f"decoding   {how}, with a key/value cache" + (", quantized weights" if args.quantized else ""))
    return 0
