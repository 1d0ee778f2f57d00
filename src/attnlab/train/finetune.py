"""Fine-tuning a causal language model on prompt/answer data, in NumPy: the data, the loss,
the loop, its checkpoints.

- **Data** (:func:`read_jsonl`, :func:`encode`): JSON lines of ``{"prompt", "completion"}``
  (plain text: the completion follows the prompt, then the end token) or chat
  ``{"messages": [{"role", "content"}, ...]}`` (the model's chat template renders them;
  the loss is on every assistant message). ``prompt`` and ``completion`` may also be lists
  of messages (the template then applies). The whole file is checked before anything is
  trained: a bad line is named by its number.
- **The loss** (:func:`causal_lm_loss_`): cross-entropy of each answer token given the
  tokens before it; prompt tokens and padding count for nothing.
- **The loop** (:class:`Finetuner`): batches of different lengths padded on the right,
  gradient accumulation (the loss is the mean over every answer token of the accumulated
  batch), AdamW with linear warm-up and cosine decay, gradient clipping, an evaluation loss
  every ``eval_every`` steps, checkpoints every ``save_every`` steps and on Ctrl-C, and
  :meth:`Finetuner.resume`: the data order comes from the seed and the step, the
  optimizer's moments and the dropout generators are saved, so a resumed run continues
  exactly where the saved one stood (bit for bit, as if never stopped).
- **Methods**: LoRA (:mod:`attnlab.train.lora`: adapters, the base frozen) or full
  fine-tuning (every parameter). ``checkpoint_blocks=True`` keeps each block's input only
  and recomputes the block in the backward pass (activation checkpointing).

Shapes: ``B`` sequences, ``T`` tokens, ``V`` vocabulary. The library computes and returns;
``attnlab finetune`` prints the progress and draws the loss plot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write
from attnlab.io.files import CheckpointError, read_json, regular_file
from attnlab.io.safetensors import load_tensors, read_header, save_tensors
from attnlab.nn.module import Module
from attnlab.quant import is_quantized
from attnlab.train import lora
from attnlab.train.loop import NonFiniteLossError
from attnlab.train.optim import AdamW, clip_grad_norm_, warmup_cosine
from attnlab.train.tasks import IGNORE_INDEX

__all__ = ["DataError", "Example", "FinetuneConfig", "Finetuner", "StepInfo", "causal_lm_loss_", "collate",
           "encode", "latest_checkpoint", "load_examples", "peak_memory", "read_jsonl", "save_pretrained"]

CHECKPOINTS = "checkpoints"
FORMAT = "attnlab-finetune-1"


class DataError(ValueError):
    """A training file attnlab cannot train on: the message names the file and the line."""


# ---- data -------------------------------------------------------------------------------------
def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with a string 'role' and 'content', got "
                            f"{json.dumps(m)[:80]}")
    return messages


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """The records of a JSON-lines file, each checked: ``[(line number, record), ...]``
    (blank lines are skipped; lines count from 1).

    A record is ``{"prompt": str, "completion": str}``, ``{"prompt": [messages],
    "completion": [messages]}`` or ``{"messages": [messages]}``, a message being
    ``{"role": str, "content": str}``.

    Raises:
        FileNotFoundError: no such file.
        DataError: the first bad line (its number and what is wrong), or a file with no record.

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = pathlib.Path(d) / "data.jsonl"
    ...     _ = p.write_text('{"prompt": "2+2=", "completion": "4"}\\n{"prompt": 5}\\n')
    ...     read_jsonl(p)
    Traceback (most recent call last):
    ...
    attnlab.train.finetune.DataError: ...data.jsonl line 2: 'prompt' must be a string or a list of messages...
    """
    path = regular_file(path, "JSON-lines file")
    records = []
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            where = f"{path} line {n}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except ValueError as exc:
                raise DataError(f"{where}: not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
            if "messages" in record:
                if "prompt" in record or "completion" in record:
                    raise DataError(f"{where}: give either 'messages' or 'prompt' and 'completion', not both")
                _check_messages(record["messages"], where)
            elif "prompt" in record or "completion" in record:
                for key in ("prompt", "completion"):
                    value = record.get(key)
                    if isinstance(value, list):
                        _check_messages(value, where)
                    elif not isinstance(value, str):
                        raise DataError(f"{where}: {key!r} must be a string or a list of messages, got "
                                        f"{type(value).__name__ if value is not None else 'nothing'}")
                if isinstance(record["prompt"], list) != isinstance(record["completion"], list):
                    raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both be lists "
                                    "of messages")
                if not (record["completion"] if isinstance(record["completion"], str) else record["completion"]):
                    raise DataError(f"{where}: the completion is empty: nothing to learn")
            else:
                raise DataError(f"{where}: a record needs 'prompt' and 'completion', or 'messages'; it has "
                                f"{', '.join(map(repr, record)) or 'no keys'}")
            records.append((n, record))
    if not records:
        raise DataError(f"{path} holds no records")
    return records


@dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids (T,)`` and ``labels (T,)``, the token itself where the
    model learns it (the answer) and ``IGNORE_INDEX`` (-100) where it does not (the prompt);
    ``line``: its line in the data file (0 if none)."""

    ids: np.ndarray
    labels: np.ndarray
    line: int = 0

    @property
    def answer_tokens(self) -> int:
        """How many tokens the loss counts (the first token is never predicted)."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


def _template_variables(model) -> dict:
    """The special tokens a chat template reads (``bos_token``, ``eos_token``)."""
    tok, c, out = model.tokenizer, model.config, {}
    for key in ("bos_token_id", "eos_token_id"):
        v = getattr(c, key, None)
        v = v[0] if isinstance(v, tuple | list) else v
        if v is not None:
            out[key[:-3]] = tok.id_to_token(int(v))
    return out


def _eos(model) -> int | None:
    v = getattr(model.config, "eos_token_id", None)
    return int(v[0] if isinstance(v, tuple | list) else v) if v is not None else None


def _chat_segments(model, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, learned)`` pieces: each assistant
    message's part (its text, end token and what the template puts after it) is learned;
    the rest (system, user, the assistant's header) is not. Each cut is where the template's
    rendering of the conversation so far ends, so the pieces join to the whole rendering."""
    from attnlab.text.chat import ChatTemplate

    if getattr(model, "chat_template", None) is None:
        raise ValueError("the model has no chat template: give plain-text 'prompt' and 'completion' records")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("the conversation has no assistant message: nothing to learn")
    template, variables = ChatTemplate(model.chat_template), _template_variables(model)
    segments, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = template.render(messages[:i], add_generation_prompt=True, **variables)
        upto = template.render(messages[: i + 1], **variables)
        if not head.startswith(done) or not upto.startswith(head):
            raise ValueError("the chat template does not render a conversation as the rendering of its "
                             "beginning followed by the rest: the answers cannot be told from the prompts")
        segments += [(head[len(done):], False), (upto[len(head):], True)]
        done = upto
    whole = template.render(messages, **variables)
    if len(whole) > len(done):
        segments.append((whole[len(done):], False))
    return [(text, learned) for text, learned in segments if text]


def encode(model, record: Mapping, *, line: int = 0, max_length: int | None = None) -> Example:
    """One record (see :func:`read_jsonl`) as an :class:`Example` for ``model``'s tokenizer.

    Plain ``prompt``/``completion``: the prompt's tokens (with the tokenizer's special
    tokens), the completion's, then the model's end token (learned: the model learns to
    stop). Messages: the chat template's rendering (see :func:`_chat_segments`).

    Raises:
        ValueError: no tokenizer, no chat template for messages, an example longer than
            ``max_length`` (default: the model's context), an answer of no tokens.
    """
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError("the model has no tokenizer: fine-tuning on text needs one (load a folder with "
                         "tokenizer.json, or a .gguf file)")
    if "messages" in record:
        segments = _chat_segments(model, record["messages"])
    elif isinstance(record["prompt"], list):
        segments = _chat_segments(model, [*record["prompt"], *record["completion"]])
    else:
        segments = [(record["prompt"], False), (record["completion"], True)]
    ids, labels = [], []
    for i, (text, learned) in enumerate(segments):
        part = tok.encode(text, add_special_tokens=i == 0).ids
        ids += part
        labels += part if learned else [IGNORE_INDEX] * len(part)
    if "messages" not in record and not isinstance(record["prompt"], list):
        eos = _eos(model)
        if eos is not None:
            ids.append(eos)
            labels.append(eos)
    limit = model.max_positions if max_length is None else max_length
    if len(ids) > limit:
        what = "the context" if max_length is None else "max_length"
        raise ValueError(f"the example has {len(ids)} tokens, more than {what} ({limit}): shorten its prompt or "
                         "completion")
    ex = Example(np.array(ids, dtype=np.int64), np.array(labels, dtype=np.int64), line)
    if ex.answer_tokens == 0:
        raise ValueError("the answer has no tokens: nothing to learn")
    return ex


def load_examples(model, path: str | os.PathLike, *, max_length: int | None = None) -> list[Example]:
    """Every record of a JSON-lines file (:func:`read_jsonl`) encoded for ``model``
    (:func:`encode`), all checked before any is returned.

    Raises:
        FileNotFoundError: no such file.
        DataError: a bad line: its number and what is wrong.
    """
    out = []
    for n, record in read_jsonl(path):
        try:
            out.append(encode(model, record, line=n, max_length=max_length))
        except ValueError as exc:
            raise DataError(f"{path} line {n}: {exc}") from None
    return out


def collate(examples: Sequence[Example], *, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, attention_mask, labels)``, each ``(B, T)`` for ``T`` the longest example,
    padded on the right (``attention_mask`` 0 and the label ``IGNORE_INDEX`` there).

    >>> ex = [Example(np.array([5, 6, 7]), np.array([-100, 6, 7])), Example(np.array([8, 9]), np.array([-100, 9]))]
    >>> ids, mask, labels = collate(ex)
    >>> ids.tolist(), mask.tolist(), labels.tolist()
    ([[5, 6, 7], [8, 9, 0]], [[1, 1, 1], [1, 1, 0]], [[-100, 6, 7], [-100, 9, -100]])
    """
    T = max(len(e.ids) for e in examples)
    ids = np.full((len(examples), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(examples), T), dtype=np.int64)
    labels = np.full((len(examples), T), IGNORE_INDEX, dtype=np.int64)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n], mask[i, :n], labels[i, :n] = e.ids, 1, e.labels
    return ids, mask, labels


# ---- the loss ---------------------------------------------------------------------------------
_LOSS_ROWS = 64  # rows of the logits turned into their gradient at a time (a (64, V) temporary)


def causal_lm_loss_(logits: np.ndarray, labels: np.ndarray, *, scale: float = 1.0,
                    grad: bool = True) -> tuple[float, int]:
    """The summed cross-entropy of the answer tokens: position ``t`` predicts ``labels[t +
    1]`` (labels equal to ``IGNORE_INDEX`` count for nothing); returns ``(loss_sum, count)``.

    With ``grad`` (the default) ``logits`` ``(B, T, V)`` is **overwritten** with the gradient
    of ``scale * loss_sum`` (zero at the positions that predict nothing), which is what
    ``model.backward`` takes: no second logits-sized array. Computed in the logits' dtype,
    summed in float64.

    >>> logits = np.zeros((1, 3, 4))
    >>> causal_lm_loss_(logits, np.array([[-100, 1, 2]]), scale=0.5)   # 2 answers, log(4) each
    (2.772588722239781, 2)
    >>> logits[0].round(3).tolist()
    [[0.125, -0.375, 0.125, 0.125], [0.125, 0.125, -0.375, 0.125], [0.0, 0.0, 0.0, 0.0]]
    """
    V = logits.shape[-1]
    target = np.full(labels.shape, IGNORE_INDEX, dtype=np.int64)
    target[..., :-1] = labels[..., 1:]
    flat, t = logits.reshape(-1, V), target.reshape(-1)
    total, count = 0.0, 0
    dt = logits.dtype.type
    for a in range(0, flat.shape[0], _LOSS_ROWS):
        blk, tt = flat[a:a + _LOSS_ROWS], t[a:a + _LOSS_ROWS]
        keep = tt != IGNORE_INDEX
        rows = blk[keep]  # a copy: (k, V)
        if grad:
            blk[~keep] = 0
        if not len(rows):
            continue
        k = np.arange(len(rows))
        rows -= rows.max(axis=1, keepdims=True)
        picked = rows[k, tt[keep]].copy()
        np.exp(rows, out=rows)
        s = rows.sum(axis=1)
        total += float(np.sum(np.log(s) - picked, dtype=np.float64))
        count += len(rows)
        if grad:
            rows /= s[:, None]
            rows[k, tt[keep]] -= 1
            rows *= dt(scale)
            blk[keep] = rows
    return total, count


# ---- memory -----------------------------------------------------------------------------------
def peak_memory() -> int | None:
    """The process's peak resident memory in bytes (Linux ``VmHWM``; elsewhere
    ``ru_maxrss``), or None where neither is known."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    except (ImportError, OSError):
        return None


# ---- the loop ---------------------------------------------------------------------------------
METHODS = ("lora", "full")


@dataclass(frozen=True)
class FinetuneConfig:
    """What :class:`Finetuner` trains and how (the defaults of ``attnlab finetune``).

    Attributes:
        method: ``"lora"`` (adapters, base frozen) or ``"full"`` (every parameter).
        r, alpha, dropout, target_modules, use_rslora: the adapters (see
            :func:`attnlab.train.lora.add`); a model that already has adapters keeps its own.
        epochs: passes over the data (``steps`` None).
        steps: optimizer steps (None: ``epochs`` passes, rounded up).
        batch_size: examples per forward pass (micro-batch).
        grad_accum: micro-batches per optimizer step.
        lr: peak learning rate; ``warmup`` steps of linear warm-up from 0, then cosine decay
            to ``min_lr_ratio * lr`` at the last step.
        weight_decay, betas, eps: AdamW's.
        clip: the gradients' global norm is clipped to this (None: no clipping).
        eval_every: the evaluation loss every this many steps and at the end (None: only
            at the end, when there is evaluation data).
        save_every: a checkpoint every this many steps (None: only on Ctrl-C and at the end).
        seed: the data order (and the adapters' start and dropout).
        checkpoint_blocks: recompute each block in the backward pass instead of keeping its
            activations (less memory, about one more forward pass of time).
    """

    method: str = "lora"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    use_rslora: bool = False
    epochs: float = 3.0
    steps: int | None = None
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 2e-4
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float | None = 1.0
    eval_every: int | None = None
    save_every: int | None = None
    seed: int = 0
    checkpoint_blocks: bool = False

    def __post_init__(self) -> None:
        from attnlab._validation import positive_int, probability

        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        positive_int(self.r, "r")
        probability(self.dropout, "dropout")
        for name in ("batch_size", "grad_accum"):
            positive_int(getattr(self, name), name)
        for name in ("steps", "eval_every", "save_every"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), name)
        positive_int(self.warmup, "warmup", allow_zero=True)
        positive_int(self.seed, "seed", allow_zero=True)
        for name in ("lr", "alpha", "epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a positive number or None, got {self.clip}")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules) if not isinstance(self.target_modules, str) \
            else self.target_modules
        d["betas"] = list(self.betas)
        return d


# What may differ between a checkpoint's run and the run resuming it.
_RESUMABLE_CHANGES = ("eval_every", "save_every")


@dataclass
class StepInfo:
    """What one optimizer step did: ``loss`` (mean over its answer tokens), ``lr``,
    ``grad_norm`` (before clipping), ``tokens`` (real tokens run, prompts included),
    ``answer_tokens``, ``seconds``; ``eval_loss`` after an evaluation at this step."""

    step: int
    steps: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    answer_tokens: int
    seconds: float
    eval_loss: float | None = None


@contextlib.contextmanager
def _interrupts_after():
    """Ctrl-C inside the block is held until it ends (the main thread only; elsewhere
    nothing changes): an optimizer step and its bookkeeping are never half done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught:
        raise KeyboardInterrupt


def _rngs(model: Module) -> list[np.random.Generator]:
    """The random generators of ``model``'s modules (dropout masks), each once, in order."""
    out, seen = [], set()
    for _, m in model.named_modules():
        g = m.__dict__.get("_rng")
        if isinstance(g, np.random.Generator) and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _digest(examples: Sequence[Example]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(np.int64(len(e.ids)).tobytes())
        h.update(e.ids.astype(np.int64).tobytes())
        h.update(e.labels.astype(np.int64).tobytes())
    return h.hexdigest()


class Finetuner:
    """Fine-tunes ``model`` on ``train`` examples (see the module docstring).

    Args:
        model: a causal language model (GPT-2, Llama, Mistral, Qwen2/3, Gemma 2/3) with
            float weights; changed in place (LoRA: adapters added unless it has some).
        train: the training :class:`Example`\\ s.
        config: a :class:`FinetuneConfig`.
        eval: examples for the evaluation loss (None: none).
        out: a folder for checkpoints (``out/checkpoints/step-N``); None: no checkpoints.

    The data order: example ``i`` of the run (counting on across epochs) is position
    ``i % n`` of the permutation ``default_rng([seed, i // n])`` of the ``n`` examples; step
    ``s`` (from 1) takes examples ``(s - 1) E`` to ``s E - 1``, ``E = batch_size *
    grad_accum``. It depends on the seed and the step alone, so a resumed run sees what the
    stopped one would have seen.

    Raises:
        TypeError: quantized weights (load the model dequantized), a model without backward.
        ValueError: no training examples; LoRA options that match no layer (see
            :func:`attnlab.train.lora.add`).
    """

    def __init__(self, model: Module, train: Sequence[Example], config: FinetuneConfig | None = None, *,
                 eval: Sequence[Example] | None = None, out: str | os.PathLike | None = None):
        self.config = c = config or FinetuneConfig()
        if not train:
            raise ValueError("no training examples")
        quantized = [n for n, p in model.named_parameters() if is_quantized(p.data)]
        if quantized:
            what = "a full fine-tune" if c.method == "full" else "training (LoRA trains beside the weights, but " \
                "its backward pass runs through them)"
            raise TypeError(f"{quantized[0]} and {len(quantized) - 1} more weights are kept quantized: {what} needs "
                            "float weights; load the model dequantized (load_smollm2() or from_pretrained(path) "
                            "without quantized=True)")
        self.model, self.train_examples, self.eval_examples = model, list(train), list(eval or [])
        self.out = None if out is None else Path(out)
        if c.method == "lora":
            if not lora.adapters(model):
                lora.add(model, r=c.r, alpha=c.alpha, dropout=c.dropout, target_modules=c.target_modules,
                         use_rslora=c.use_rslora, rng=np.random.default_rng([c.seed, 3]))
        else:
            if lora.adapters(model):
                raise ValueError("the model has LoRA adapters: a full fine-tune trains the model's own parameters; "
                                 "load it without adapters (or merge them first and drop them)")
            model.requires_grad_(True)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.optimizer = AdamW([p for _, p in self.params], lr=c.lr, betas=c.betas, eps=c.eps,
                               weight_decay=c.weight_decay)
        per_step = c.batch_size * c.grad_accum
        self.steps = c.steps if c.steps is not None else max(1, math.ceil(c.epochs * len(self.train_examples)
                                                                          / per_step))
        self.step = 0
        self.history: dict[str, list] = {"step": [], "loss": [], "lr": [], "grad_norm": [], "tokens": [],
                                         "seconds": [], "eval_step": [], "eval_loss": []}
        self.digest = _digest(self.train_examples)
        # The dropout generators' states where the last completed step left them (what a
        # checkpoint saves: a step cut short by Ctrl-C may have drawn from them already).
        self._rng_states = [g.bit_generator.state for g in _rngs(model)]
        self._orders: dict[int, np.ndarray] = {}
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    # ---- data order ------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.config.seed, epoch]).permutation(
                len(self.train_examples))}
        return self._orders[epoch]

    def micro_batches(self, step: int) -> list[list[Example]]:
        """The micro-batches of (1-based) ``step``: ``grad_accum`` lists of ``batch_size``
        examples."""
        c, n = self.config, len(self.train_examples)
        first = (step - 1) * c.batch_size * c.grad_accum
        out = []
        for j in range(c.grad_accum):
            batch = []
            for i in range(first + j * c.batch_size, first + (j + 1) * c.batch_size):
                batch.append(self.train_examples[int(self._order(i // n)[i % n])])
            out.append(batch)
        return out

    def lr_at(self, step: int) -> float:
        c = self.config
        return warmup_cosine(step, lr=c.lr, steps=self.steps, warmup=c.warmup, min_lr_ratio=c.min_lr_ratio)

    # ---- one step ----------------------------------------------------------------------------
    def train_step(self) -> StepInfo:
        """One optimizer step over ``grad_accum`` micro-batches: the gradient of the mean
        loss over all their answer tokens, clipped, then AdamW at this step's learning rate.

        Raises:
            NonFiniteLossError: a NaN or infinite loss (the weights are left as they were).
        """
        c, model = self.config, self.model
        step = self.step + 1
        start = time.perf_counter()
        batches = [collate(b, pad_id=self.pad_id) for b in self.micro_batches(step)]
        answers = sum(int((labels[:, 1:] != IGNORE_INDEX).sum()) for _, _, labels in batches)
        object.__setattr__(model, "checkpoint_blocks", c.checkpoint_blocks)
        model.train()
        for _, p in self.params:
            p.grad = None
        total, tokens = 0.0, 0
        with np.errstate(over="ignore", invalid="ignore"):
            for ids, mask, labels in batches:
                logits = model(ids, attention_mask=mask)
                loss, _ = causal_lm_loss_(logits, labels, scale=1.0 / answers)
                total += loss
                tokens += int(mask.sum())
                if not math.isfinite(total):
                    for _, p in self.params:
                        p.grad = None
                    raise NonFiniteLossError(step, total)
                model.backward(logits)
                del logits
        params = [p for _, p in self.params]
        norm = clip_grad_norm_(params, c.clip if c.clip is not None else math.inf)
        lr = self.lr_at(step)
        with _interrupts_after():
            self.optimizer.lr = lr
            self.optimizer.step()
            for _, p in self.params:
                p.grad = None
            self.step = step
            self._rng_states = [g.bit_generator.state for g in _rngs(model)]
            info = StepInfo(step, self.steps, total / answers, lr, norm, tokens, answers, time.perf_counter() - start)
            for key in ("step", "loss", "lr", "grad_norm", "tokens", "seconds"):
                self.history[key].append(getattr(info, key))
        return info

    def evaluate(self) -> float:
        """The mean loss over every answer token of the evaluation examples (eval mode: no
        dropout), in micro-batches of ``batch_size``; NaN without evaluation examples."""
        if not self.eval_examples:
            return float("nan")
        model, was = self.model, self.model.training
        model.eval()
        total, count = 0.0, 0
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                for i in range(0, len(self.eval_examples), self.config.batch_size):
                    ids, mask, labels = collate(self.eval_examples[i:i + self.config.batch_size], pad_id=self.pad_id)
                    loss, n = causal_lm_loss_(model(ids, attention_mask=mask), labels, grad=False)
                    total, count = total + loss, count + n
        finally:
            model.train(was)
        return total / count

    def run(self, on_step: Callable[[StepInfo], None] | None = None) -> dict[str, list]:
        """Train until :attr:`steps` (from where the run stands: 0, or a resumed step);
        ``on_step(info)`` after each step. Returns the history.

        Checkpoints (with ``out``): every ``save_every`` steps, at the end, and when
        interrupted (Ctrl-C, or any error) at the last completed step; then the exception
        goes on.
        """
        c = self.config
        try:
            while self.step < self.steps:
                info = self.train_step()
                last = self.step == self.steps
                if self.eval_examples and ((c.eval_every and self.step % c.eval_every == 0) or last):
                    info.eval_loss = self.evaluate()
                    self.history["eval_step"].append(self.step)
                    self.history["eval_loss"].append(info.eval_loss)
                if self.out is not None and (last or (c.save_every and self.step % c.save_every == 0)):
                    self.save_checkpoint()
                if on_step is not None:
                    on_step(info)
        except BaseException:
            if self.out is not None and self.step and self._latest_step() != self.step:
                with _interrupts_after():
                    self.save_checkpoint()
            raise
        return self.history

    # ---- checkpoints -------------------------------------------------------------------------
    def _folder(self) -> Path:
        if self.out is None:
            raise ValueError("this Finetuner has no out folder for checkpoints")
        return self.out / CHECKPOINTS

    def _latest_step(self) -> int | None:
        found = latest_checkpoint(self.out) if self.out is not None else None
        return None if found is None else int(found.name.split("-")[1])

    def save_checkpoint(self) -> Path:
        """Write the run's state at the current step to ``out/checkpoints/step-N`` (the
        trained parameters, the optimizer's moments, the dropout generators, the history,
        the config and the data's digest), atomically: written beside, then renamed into
        place; older checkpoints are removed after. Returns the folder."""
        root = self._folder()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step:07d}"
        tmp = root / f".step-{self.step:07d}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            save_tensors(tmp / "trained.safetensors", {n: p.data for n, p in self.params})
            moments = {}
            steps = {}
            for (n, _), state in zip(self.params, self.optimizer.state, strict=True):
                if state:
                    moments[f"exp_avg/{n}"] = state["exp_avg"]
                    moments[f"exp_avg_sq/{n}"] = state["exp_avg_sq"]
                    steps[n] = state["step"]
            save_tensors(tmp / "optimizer.safetensors", moments)
            meta = {"format": FORMAT, "step": self.step, "steps": self.steps, "config": self.config.to_dict(),
                    "data": {"examples": len(self.train_examples), "sha256": self.digest},
                    "model": getattr(self.model, "name", type(self.model).__name__),
                    "optimizer_steps": steps, "rngs": self._rng_states,
                    "history": self.history}
            (tmp / "state.json").write_text(json.dumps(meta))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in root.iterdir():  # older checkpoints, and what a killed run left half-written
            if old != final and (old.name.startswith("step-") or old.name.startswith(".step-")):
                shutil.rmtree(old, ignore_errors=True)
        return final

    def resume(self, folder: str | os.PathLike | None = None) -> int:
        """Continue from a checkpoint (default: the latest in ``out``): parameters, optimizer,
        generators, history and step; returns the step. The config must be the saved one
        (``eval_every`` and ``save_every`` may change) and the data the same.

        Raises:
            FileNotFoundError: no checkpoint.
            CheckpointError: a checkpoint of another run (the difference named) or a damaged one.
        """
        path = Path(folder) if folder is not None else latest_checkpoint(self.out)
        if path is None:
            raise FileNotFoundError(2, "no checkpoint to resume from", str(self._folder()))
        meta = read_json(path / "state.json")
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not an attnlab fine-tuning checkpoint")
        saved, now = dict(meta.get("config", {})), self.config.to_dict()
        diff = [k for k in now if k not in _RESUMABLE_CHANGES and saved.get(k) != now[k]]
        if diff:
            k = diff[0]
            raise CheckpointError(f"{path}: the checkpoint's run has {k}={saved.get(k)!r}, this one {now[k]!r}: "
                                  "resume with the same settings")
        if meta.get("data", {}).get("sha256") != self.digest:
            raise CheckpointError(f"{path}: the training data differ from the checkpoint's run (its "
                                  f"{meta.get('data', {}).get('examples')} examples): resume with the same data")
        names = [n for n, _ in self.params]
        infos = read_header(path / "trained.safetensors")[0]
        own = dict(self.params)
        if sorted(infos) != sorted(names):
            raise CheckpointError(f"{path}: it holds other trained parameters than this run's")
        for n, info in infos.items():
            if tuple(info.shape) != own[n].shape:
                raise CheckpointError(f"{path}: {n} has shape {info.shape}, this model's {own[n].shape}")
        trained = load_tensors(path / "trained.safetensors", names, dtype=self.model.dtype)
        moments = load_tensors(path / "optimizer.safetensors", list(read_header(path / "optimizer.safetensors")[0]),
                               dtype=self.model.dtype)
        steps = meta.get("optimizer_steps", {})
        for (n, p), state in zip(self.params, self.optimizer.state, strict=True):
            p.data[...] = trained[n]
            state.clear()
            if n in steps:
                state.update(step=int(steps[n]), exp_avg=moments[f"exp_avg/{n}"].copy(),
                             exp_avg_sq=moments[f"exp_avg_sq/{n}"].copy())
        rngs = _rngs(self.model)
        if len(rngs) != len(meta.get("rngs", [])):
            raise CheckpointError(f"{path}: it saved {len(meta.get('rngs', []))} random generators, this model has "
                                  f"{len(rngs)}")
        for g, state in zip(rngs, meta["rngs"], strict=True):
            g.bit_generator.state = state
        self._rng_states = [g.bit_generator.state for g in rngs]
        self.history = {k: list(v) for k, v in meta["history"].items()}
        self.step = int(meta["step"])
        return self.step


def latest_checkpoint(out: str | os.PathLike | None) -> Path | None:
    """The newest complete checkpoint folder ``out/checkpoints/step-N``, or None."""
    if out is None:
        return None
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return None
    found = sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "state.json").is_file())
    return found[-1] if found else None


# ---- the full model as a transformers folder --------------------------------------------------
def save_pretrained(model: Module, folder: str | os.PathLike) -> Path:
    """Write ``model`` as a Hugging Face folder attnlab and ``transformers`` load:
    ``config.json``, ``model.safetensors`` (``transformers``' names, the stacked q/k/v split,
    GPT-2's ``Conv1D`` weights transposed back), and its tokenizer (``tokenizer.json``,
    ``tokenizer_config.json`` with the chat template). Llama-family models (Llama,
    Mistral, Qwen2, Qwen3) and GPT-2. Returns the folder.

    Raises:
        TypeError: another family, or quantized weights.
        OSError: a folder that cannot be written.
    """
    from attnlab.models.gpt2 import GPT2
    from attnlab.models.llama import Llama

    if type(model) is Llama:
        from attnlab.interop import llama_hf_config

        config = llama_hf_config(model.config)
    elif type(model) is GPT2:
        config = {**model.config.to_dict(), "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    else:
        raise TypeError(f"save_pretrained writes Llama-family and GPT-2 models, not {type(model).__name__}")
    params = dict(model.named_parameters())
    if any(is_quantized(p.data) for p in params.values()):
        raise TypeError("the model's weights are quantized: save_pretrained writes float weights")
    modules = dict(model.named_modules())
    conv1d = getattr(type(model), "conv1d_weights", lambda c: frozenset())(model.config)
    tensors = {}
    for ours, sources in type(model).name_map(model.config).items():
        data = np.asarray(params[ours].data)
        owner = modules[ours.rpartition(".")[0]]
        sizes = lora._row_sizes(owner, len(sources), data.shape[0], ours)
        for src, part in zip(sources, np.split(data, np.cumsum(sizes)[:-1]), strict=True):
            tensors[src] = np.ascontiguousarray(part.T if ours in conv1d else part)
    folder = lora._writable_folder(Path(folder))
    save_tensors(folder / "model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write(folder / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    if model.tokenizer is not None:
        atomic_write(folder / "tokenizer.json", lambda tmp: model.tokenizer.save(str(tmp)))
        extra = {"chat_template": model.chat_template} if getattr(model, "chat_template", None) else {}
        atomic_write(folder / "tokenizer_config.json", lambda tmp: tmp.write_text(json.dumps(extra, indent=2)))
    return folder

