"""attnlab.text: from a sentence to token vectors.

:class:`Tokenizer` (words and punctuation with character spans), :class:`Vocabulary`
(``<pad>``/``<unk>``, JSON), :func:`one_hot`, :class:`Embedding` (a random table from a
Generator; it is :class:`attnlab.nn.Embedding`), :func:`sinusoidal_positions`,
:class:`Word2VecEmbedding` (gensim, optional), :func:`text_to_embeddings`, and
:func:`readable_token` (a tokenizer's token as a person reads it: ``ĠParis`` -> ``␣Paris``).
:func:`attnlab.explain.random_model` runs the random-weight teaching model on them.
"""

from attnlab.nn.layers import Embedding
from attnlab.text.embedding import Word2VecEmbedding, one_hot, sinusoidal_positions
from attnlab.text.pipeline import text_to_embeddings
from attnlab.text.tokenizer import Token, Tokenizer
from attnlab.text.tokens import readable_token, readable_tokens, token_scheme
from attnlab.text.vocab import PAD, UNK, Vocabulary

__all__ = [
    "PAD",
    "UNK",
    "Embedding",
    "Token",
    "Tokenizer",
    "Vocabulary",
    "Word2VecEmbedding",
    "one_hot",
    "readable_token",
    "readable_tokens",
    "sinusoidal_positions",
    "text_to_embeddings",
    "token_scheme",
]
