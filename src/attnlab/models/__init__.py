"""attnlab.models"""

from attnlab.models.tiny import TinyTransformer as TinyTransformer  # noqa: E402  (issue 4)
from attnlab.models.tiny import TinyTransformerConfig as TinyTransformerConfig  # noqa: E402
