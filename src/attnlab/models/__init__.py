"""attnlab.models"""

from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig  # noqa: E402  (issue 4)
