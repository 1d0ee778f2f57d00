"""attnlab.models: pretrained encoders run by attnlab's own attention.

:mod:`attnlab.models.bert` holds a BERT encoder in NumPy and the bundled
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

__all__ = ["BertConfig", "BertEncoder", "CheckpointError", "load_minilm", "minilm_available"]

from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig  # noqa: E402  (issue 4)

__all__ += ["TinyTransformer", "TinyTransformerConfig"]
