"""Tokens shown as text (attnlab.text.readable_token): byte-level BPE and SentencePiece
codes undone for display, one mark for a space, escapes for partial bytes."""

from __future__ import annotations

import re

import pytest

from attnlab.text import readable_token, readable_tokens, token_scheme

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    from tokenizers import Tokenizer

    from helpers import byte_bpe_tokenizer

    return Tokenizer.from_file(str(byte_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def _unmarked(text: str) -> str:
    return text.replace("\u2423", " ").replace("\u23ce", "\n").replace("\u21e5", "\t")


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "café au lait\n\tnaïve", "日本語 and 😀"])
def test_byte_level_tokens_read_as_the_text_they_spell(byte_level, text):
    enc = byte_level.encode(text)
    shown = readable_tokens(enc.tokens)
    assert token_scheme(byte_level) == "byte-level"
    joined = "".join(shown)
    assert not any(ch in joined for ch in "ĠĊĉ")
    # a character split across tokens shows as its bytes (<0xC3><0xA9>): they spell it back
    spelled = re.sub(r"(?:<0x[0-9A-F]{2}>)+", lambda m: bytes.fromhex(m.group(0)[3:-1].replace("><0x", "")).decode(),
                     _unmarked(joined))
    assert spelled == text
    assert "\u2423" in joined  # a visible mark for the spaces


def test_marks_and_escapes():
    assert readable_token("ĠParis") == "\u2423Paris"
    assert readable_token("Ġ") == "\u2423" and readable_token("ĠĠ") == "\u2423\u2423"
    assert readable_token("Ċ") == "\u23ce" and readable_token("ĉ") == "\u21e5"
    assert readable_token("Ã©") == "é" and readable_token("Ã") == "<0xC3>" and readable_token("©") == "<0xA9>"
    assert readable_token("Âł") == "\u237d"  # a no-break space
    assert readable_token("<|im_start|>") == "<|im_start|>"
    assert readable_token("ðŁĺ") == "<0xF0><0x9F><0x98>"  # three of an emoji's four bytes
    assert readable_token("▁Paris", "sentencepiece") == "\u2423Paris"
    assert readable_token("<0x0A>", "sentencepiece") == "<0x0A>"
    assert readable_token("##ing", "plain") == "##ing" and readable_token("a b", "plain") == "a\u2423b"
    with pytest.raises(ValueError, match="scheme must be one of"):
        readable_token("x", "bpe")
    with pytest.raises(TypeError, match="token must be a str"):
        readable_token(3)


def test_every_smollm2_token_reads_as_text(smollm2_gguf):
    tok = smollm2_gguf.tokenizer()
    assert token_scheme(tok) == "byte-level"
    vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    shown = readable_tokens(vocab)
    assert not any(ch in "".join(shown) for ch in "ĠĊ")
    assert shown[7042] == "\u2423Paris" and tok.id_to_token(7042) == "ĠParis"


def test_the_scheme_of_other_tokenizers():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    assert token_scheme(wordpiece) == "plain"
    sp = Tokenizer(models.BPE())
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    assert token_scheme(sp) == "sentencepiece"
    llama = Tokenizer(models.BPE())
    llama.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert token_scheme(llama) == "sentencepiece"
    assert token_scheme(Tokenizer(models.BPE())) == "plain"
