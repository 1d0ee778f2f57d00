"""``Tokenizer``: words and punctuation, each token with its character span in the text."""

from __future__ import annotations

import re
from dataclasses import dataclass

# A word is a run of letters/digits/underscores, optionally joined by inner apostrophes or
# hyphens ("don't", "state-of-the-art"); every other non-space character is a token alone.
_TOKEN_RE = re.compile(r"\w+(?:['’\-]\w+)*|[^\w\s]")


@dataclass(frozen=True)
class Token:
    """One token: its (possibly lower-cased) ``text`` and the span ``text[start:end]`` of the
    original string it came from."""

    text: str
    start: int
    end: int


class Tokenizer:
    """Split text into words and punctuation marks, keeping each token's character span.

    Lower-casing and splitting on spaces alone would make "mat." one unknown word; here
    punctuation is a token of its own and the span points back into the original text
    (for highlighting, or for mapping tokens to word pieces).

    Args:
        lowercase: lower-case the token texts (the spans still index the original text).

    >>> tok = Tokenizer()
    >>> tok("The cat sat on the mat.")
    ['the', 'cat', 'sat', 'on', 'the', 'mat', '.']
    >>> tok.tokenize("Don't panic!")[0]
    Token(text="don't", start=0, end=5)
    >>> Tokenizer(lowercase=False)("Hello, World")
    ['Hello', ',', 'World']
    """

    def __init__(self, *, lowercase: bool = True):
        self.lowercase = bool(lowercase)

    def tokenize(self, text: str) -> list[Token]:
        """The tokens of ``text`` with their spans, in order; ``[]`` for blank text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        tokens = []
        for m in _TOKEN_RE.finditer(text):
            word = m.group()
            tokens.append(Token(word.lower() if self.lowercase else word, m.start(), m.end()))
        return tokens

    def __call__(self, text: str) -> list[str]:
        """The token strings of ``text``."""
        return [t.text for t in self.tokenize(text)]

    def __repr__(self) -> str:
        return f"Tokenizer(lowercase={self.lowercase})"
