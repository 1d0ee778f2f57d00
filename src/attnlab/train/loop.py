"""The training loop for :class:`~attnlab.models.TinyTransformer` on associative recall.

The library computes and returns; the CLI (``attnlab train``) prints, plots and saves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from attnlab._validation import positive_int
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.nn.loss import CrossEntropyLoss
from attnlab.train.optim import AdamW, clip_grad_norm_, warmup_cosine
from attnlab.train.tasks import IGNORE_INDEX, RecallTask

__all__ = ["NonFiniteLossError", "TrainConfig", "Trainer", "answer_accuracy"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; ``step`` is the step that produced it."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss is {loss} at step {step}: training stopped")
        self.step, self.loss = step, loss


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of :class:`Trainer` (the defaults of ``attnlab train``).

    AdamW with linear warm-up then cosine decay to ``min_lr_ratio * lr``, gradient
    clipping at ``clip`` (None: off).
    """

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 100
    min_lr_ratio: float = 0.05
    clip: float | None = 1.0
    seed: int = 0
    eval_size: int = 2000

    def __post_init__(self) -> None:
        positive_int(self.steps, "steps")
        positive_int(self.batch_size, "batch_size")
        positive_int(self.eval_size, "eval_size")
        positive_int(self.warmup, "warmup", allow_zero=True)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict:
        return asdict(self)


def answer_accuracy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Fraction of answer positions (targets != IGNORE_INDEX) whose argmax is right."""
    keep = targets != IGNORE_INDEX
    if not keep.any():
        return float("nan")
    return float((logits.argmax(axis=-1)[keep] == targets[keep]).mean())


@dataclass
class Trainer:
    """Owns the model, the optimizer, the data streams and the history of one run.

    Training batches come from ``default_rng(seed)``; the held-out set is drawn once from
    an independent stream (``default_rng([seed, 1])``), so it never feeds training.
    """

    model: TinyTransformer
    task: RecallTask
    config: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        c = self.config
        self.rng = np.random.default_rng(c.seed)
        self.heldout = self.task.sample(c.eval_size, rng=np.random.default_rng([c.seed, 1]))
        self.optimizer = AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.loss_fn = CrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self.step = 0
        self.history: dict[str, list[float]] = {"step": [], "loss": [], "accuracy": [], "lr": []}
        self.good_state = self.model.state_dict()  # weights whose loss was finite
        self.good_step = 0

    @classmethod
    def build(
        cls,
        task: RecallTask | None = None,
        model_config: TinyTransformerConfig | None = None,
        config: TrainConfig | None = None,
        *,
        attention_fn=None,
    ) -> Trainer:
        """A trainer with a fresh model sized for ``task`` (vocabulary and context)."""
        task = task or RecallTask()
        config = config or TrainConfig()
        mc = model_config or TinyTransformerConfig()
        if mc.vocab_size != task.vocab_size or mc.context_length < task.seq_len:
            mc = TinyTransformerConfig(
                **{**mc.to_dict(), "vocab_size": task.vocab_size,
                   "context_length": max(mc.context_length, task.seq_len)}
            )
        rng = np.random.default_rng([config.seed, 2])
        return cls(TinyTransformer(mc, rng=rng, attention_fn=attention_fn), task, config)

    def lr_at(self, step: int) -> float:
        """Learning rate of (1-based) ``step``: linear warm-up, then cosine decay."""
        c = self.config
        return warmup_cosine(step, lr=c.lr, steps=c.steps, warmup=c.warmup, min_lr_ratio=c.min_lr_ratio)

    def train_step(self) -> tuple[float, float]:
        """One optimisation step; returns ``(loss, accuracy)`` on its batch.

        Raises:
            NonFiniteLossError: the loss is NaN or inf (the weights are left untouched
                and :attr:`good_state` holds the last weights with a finite loss).
        """
        ids, targets = self.task.sample(self.config.batch_size, rng=self.rng)
        self.model.train()
        step = self.step + 1
        # Overflow is detected below as a non-finite loss, with a clear error.
        with np.errstate(over="ignore", invalid="ignore"):
            logits = self.model(ids)
            loss = self.loss_fn(logits, targets)
            if not math.isfinite(loss):
                raise NonFiniteLossError(step, loss)
            self.good_state, self.good_step = self.model.state_dict(), self.step
            self.model.zero_grad()
            self.model.backward(self.loss_fn.backward())
            if self.config.clip is not None:
                clip_grad_norm_(self.model.parameters(), self.config.clip)
            lr = self.lr_at(step)
            self.optimizer.lr = lr
            self.optimizer.step()
        self.step = step
        acc = answer_accuracy(logits, targets)
        for k, v in (("step", step), ("loss", loss), ("accuracy", acc), ("lr", lr)):
            self.history[k].append(v)
        return loss, acc

    def evaluate(self, *, limit: int | None = None, chunk: int = 500) -> tuple[float, float]:
        """``(loss, accuracy)`` on the held-out set (its first ``limit`` sequences), in
        eval mode."""
        ids, targets = self.heldout
        if limit is not None:
            ids, targets = ids[:limit], targets[:limit]
        was = self.model.training
        self.model.eval()
        loss_fn = CrossEntropyLoss(ignore_index=IGNORE_INDEX).eval()
        total, n, correct = 0.0, 0, 0
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                for i in range(0, len(ids), chunk):
                    logits = self.model(ids[i : i + chunk])
                    t = targets[i : i + chunk]
                    k = int((t != IGNORE_INDEX).sum())
                    total += loss_fn(logits, t) * k
                    n += k
                    correct += int((logits.argmax(-1) == t)[t != IGNORE_INDEX].sum())
        finally:
            self.model.train(was)
        return total / n, correct / n
