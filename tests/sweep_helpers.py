"""Methods and models the sweep tests hand to worker processes (which import them by name)."""

from __future__ import annotations

import os

import numpy as np

from attnlab.models import GPT2, GPT2Config

#: token ids at whose sight :func:`die_on_marker` ends its process
MARKER = 49


def tiny_gpt2() -> GPT2:
    return GPT2(GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4),
                rng=np.random.default_rng(0))


def last_resid(model, batch):
    """A user method: each item's last residual and its length."""
    _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask,
                                    names_filter=["blocks.1.hook_resid_post"])
    return {"last": np.asarray(cache["blocks.1.hook_resid_post"])[:, -1], "length": batch.lengths}


def die_on_marker(model, batch):
    """A method whose worker dies (no exception: the process ends) on a batch holding MARKER."""
    if (batch.input_ids == MARKER).any():
        os._exit(3)
    return last_resid(model, batch)


def fail_on_marker(model, batch):
    """A method that raises on an item holding MARKER (and computes the others)."""
    if (batch.input_ids == MARKER).any():
        raise ValueError("marker seen")
    return last_resid(model, batch)


def die_once_on_marker(model, batch):
    """A method whose worker dies on a batch holding MARKER the first time only: the file
    named by ``$ATTNLAB_TEST_DIED`` records that it did (a worker's restart comes back clean)."""
    flag = os.environ["ATTNLAB_TEST_DIED"]
    if (batch.input_ids == MARKER).any() and not os.path.exists(flag):
        open(flag, "w").close()
        os._exit(3)
    return last_resid(model, batch)
