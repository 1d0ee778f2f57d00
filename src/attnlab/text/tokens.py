"""Tokens as a person reads them.

Tokenizers write their tokens in codes: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)
maps every byte to a printable character (a leading space is ``Ġ``, a newline ``Ċ``, the
UTF-8 bytes of ``é`` are ``Ã©``), SentencePiece (Llama 2, Mistral, Gemma) marks a space
with ``▁`` and writes a lone byte as ``<0xC3>``. :func:`readable_token` undoes the code for
display: ``'ĠParis'`` reads ``'␣Paris'``. One mark for every space, ``␣`` (U+2423, so a
leading space stays visible in a table or a label), a no-break space ``⍽``; a line break is
``⏎``, a tab ``⇥``,
another control character or a byte that is only part of a character (a character
split across tokens) ``<0xNN>``.

The raw tokens stay what the tokenizer wrote wherever data is kept (the explain JSON,
:attr:`attnlab.explain.Explanation.tokens`); only what is shown changes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable

__all__ = ["SPACE", "readable_token", "readable_tokens", "token_scheme"]

#: The mark shown for a space.
SPACE = "\u2423"
_SHOWN = {" ": SPACE, "\xa0": "\u237d", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u21b5"}
SCHEMES = ("byte-level", "sentencepiece", "plain")


@functools.cache
def _byte_of() -> dict[str, int]:
    """GPT-2's byte -> character table, inverted: the character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in table.items()}


def _visible(text: str) -> str:
    """Spaces, line breaks and tabs as marks; other control characters and stray bytes
    (surrogate escapes) as ``<0xNN>``."""
    out = []
    for ch in text:
        c = ord(ch)
        if ch in _SHOWN:
            out.append(_SHOWN[ch])
        elif 0xDC80 <= c <= 0xDCFF:  # a byte that is not a whole UTF-8 character
            out.append(f"<0x{c - 0xDC00:02X}>")
        elif c < 0x20 or c == 0x7F:
            out.append(f"<0x{c:02X}>")
        else:
            out.append(ch)
    return "".join(out)


def readable_token(token: str, scheme: str = "byte-level") -> str:
    """``token`` as text a person reads (see the module's docstring).

    Args:
        token: a token as its tokenizer writes it.
        scheme: ``"byte-level"`` (GPT-2-style byte-level BPE), ``"sentencepiece"`` or
            ``"plain"`` (WordPiece, words: only spaces and control characters are marked).

    >>> readable_token("ĠParis"), readable_token("Ċ"), readable_token("Ã©t"), readable_token("Ã")
    ('␣Paris', '⏎', 'ét', '<0xC3>')
    >>> readable_token("<|im_start|>"), readable_token("▁Paris", "sentencepiece"), readable_token("##ing", "plain")
    ('<|im_start|>', '␣Paris', '##ing')
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    if scheme == "byte-level":
        table = _byte_of()
        if all(ch in table for ch in token):
            token = bytes(table[ch] for ch in token).decode("utf-8", "surrogateescape")
    elif scheme == "sentencepiece":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return token  # SentencePiece's own byte token
        token = token.replace("\u2581", " ")
    return _visible(token)


def readable_tokens(tokens: Iterable[str], scheme: str = "byte-level") -> list[str]:
    """:func:`readable_token` of each token."""
    return [readable_token(t, scheme) for t in tokens]


def token_scheme(tokenizer) -> str:
    """How a ``tokenizers.Tokenizer`` writes its tokens: ``"byte-level"`` (its decoder is
    ``ByteLevel``), ``"sentencepiece"`` (``Metaspace``, or a ``Replace`` of ``▁``), else
    ``"plain"`` (None, WordPiece, word lists)."""
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is None:
        return "plain"
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return "plain"
    kinds = [d.get("type") for d in state.get("decoders", [state])] if isinstance(state, dict) else []
    if "ByteLevel" in kinds:
        return "byte-level"
    text = json.dumps(state)
    if "Metaspace" in kinds or "\u2581" in text or "\\u2581" in text:
        return "sentencepiece"
    return "plain"
