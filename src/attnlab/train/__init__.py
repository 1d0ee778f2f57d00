"""attnlab.train: optimizers, the associative-recall task, the training loop, checkpoints."""

from attnlab.train.checkpoint import load_checkpoint, save_checkpoint
from attnlab.train.loop import NonFiniteLossError, TrainConfig, Trainer
from attnlab.train.optim import SGD, Adam, AdamW, Optimizer, clip_grad_norm_
from attnlab.train.tasks import IGNORE_INDEX, RecallTask

__all__ = [
    "IGNORE_INDEX",
    "SGD",
    "Adam",
    "AdamW",
    "NonFiniteLossError",
    "Optimizer",
    "RecallTask",
    "TrainConfig",
    "Trainer",
    "clip_grad_norm_",
    "load_checkpoint",
    "save_checkpoint",
]
