"""attnlab.models: models built from attnlab's own attention.

:mod:`attnlab.models.tiny` holds the small GPT-style :class:`TinyTransformer` that
``attnlab train`` trains; :mod:`attnlab.models.bert` a BERT encoder in NumPy and the bundled
all-MiniLM-L6-v2 model (the ``pretrained`` extra). Heavy optional dependencies
(safetensors, tokenizers) are imported only when a model is loaded.
"""

from attnlab.models.bert import (
    BertConfig,
    BertEncoder,
    CheckpointError,
    load_minilm,
    minilm_available,
)
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig

__all__ = [
    "BertConfig",
    "BertEncoder",
    "CheckpointError",
    "TinyTransformer",
    "TinyTransformerConfig",
    "load_minilm",
    "minilm_available",
]
