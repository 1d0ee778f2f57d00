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


def tiny_quantized_llama(activations: str = "float32"):
    """A 2-block Llama whose block weights are kept quantized (Q4_1 projections, a Q8_0
    feed-forward down-projection), multiplying ``activations``."""
    from attnlab.models import Llama, LlamaConfig
    from attnlab.quant import QuantizedTensor

    model = Llama(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                  rng=np.random.default_rng(3))
    rng = np.random.default_rng(4)
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and p.data.ndim == 2:
            kind = "Q8_0" if "down" in name else "Q4_1"
            w = QuantizedTensor.quantize(rng.normal(0.0, 0.15, p.data.shape).astype(np.float32), kind, name=name)
            p.data = w.with_activations(activations)
    return model


def doubled_attention(*args, **kwargs):
    """An attention function of a user's (module-level, so a worker can import it): attnlab's,
    its output doubled."""
    from attnlab.core.dispatch import scaled_dot_product_attention

    return 2 * scaled_dot_product_attention(*args, **kwargs)
