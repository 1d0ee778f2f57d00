"""attnlab.models: models built from attnlab's own attention.

:mod:`attnlab.models.tiny` holds the small GPT-style :class:`TinyTransformer` that
``attnlab train`` trains; :mod:`attnlab.models.bert` a BERT encoder in NumPy and the bundled
all-MiniLM-L6-v2 model (the ``pretrained`` extra); :mod:`attnlab.models.gpt2` GPT-2, which
loads Hugging Face checkpoints. Both decoders generate with a key/value cache
(:mod:`attnlab.models.generate`). :func:`from_pretrained` loads any supported folder or
file, asking the one registry of families (:mod:`attnlab.models.registry`). Heavy optional dependencies
(safetensors, tokenizers) are imported only when a model is loaded.
"""

from attnlab.models.bert import (
    BertConfig,
    BertEncoder,
    CheckpointError,
    load_minilm,
    minilm_available,
)
from attnlab.models.decoder import CausalLMOutput
from attnlab.models.gpt2 import GPT2, GPT2Config, GPT2Output
from attnlab.models.registry import FAMILIES, detect, from_pretrained
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig

__all__ = [
    "FAMILIES",
    "BertConfig",
    "BertEncoder",
    "CausalLMOutput",
    "CheckpointError",
    "GPT2",
    "GPT2Config",
    "GPT2Output",
    "TinyTransformer",
    "TinyTransformerConfig",
    "detect",
    "from_pretrained",
    "load_minilm",
    "minilm_available",
]

# The Llama family (Llama, SmolLM2, Llama 3, Mistral, Qwen2, Qwen3) and the bundled SmolLM2
from attnlab.models.llama import Llama, LlamaConfig, load_smollm2, smollm2_available  # noqa: E402

__all__ += ["Llama", "LlamaConfig", "load_smollm2", "smollm2_available"]

# Gemma 2 and Gemma 3 (text): the Llama arrangement with soft-capping and sandwich norms
from attnlab.models.gemma import Gemma, GemmaConfig  # noqa: E402

__all__ += ["Gemma", "GemmaConfig"]
