"""``attnlab bench`` after ``make demo`` (no torch): attnlab's own rows run alone and the
output says what is skipped."""

from __future__ import annotations

import pytest

from attnlab import benchmark as bm
from attnlab.cli import main


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setattr(bm, "_torch", lambda: None)


def test_layer_rows_time_attnlab_alone(no_torch):
    rows = bm.layer_rows(threads=1, repeats=1, mha_tokens=16, gpt2_tokens=8, smollm2_tokens=0, minilm_texts=0,
                         train_steps=1, decode_tokens=2, settle=0.0, back_to_back=False)
    def row(start):
        [r] = [r for r in rows if r.name.startswith(start)]
        return r

    for name in ("MultiheadAttention(512, 8) fwd,", "MultiheadAttention(512, 8) fwd+bwd", "TinyTransformer training"):
        assert row(name).seconds["attnlab"] > 0 and row(name).seconds.get("torch") is None, name
        assert "attnlab alone: torch is not installed" in row(name).note
    for name in ("GPT-2 small prefill", "GPT-2 small decode"):
        assert not row(name).seconds and row(name).note == "skipped: needs torch (not installed)"


def test_decode_rows_time_attnlab_alone(no_torch, smollm2_model):
    models = bm.Models()
    models._cache["SmolLM2 (attnlab, float32)"] = smollm2_model
    result = bm.decode_rows(threads=1, repeats=1, new_tokens=2, settle=0.0, models=models)
    assert result is not None
    bandwidth, rows = result
    by = {r.name: r for r in rows}
    assert by["attnlab SmolLM2 float32"].tokens_per_s > 0 and by["attnlab SmolLM2 quantized"].tokens_per_s > 0
    assert by["transformers SmolLM2 float32"].tokens_per_s is None
    assert "needs torch and transformers" in by["transformers SmolLM2 float32"].note


def test_the_command_says_what_it_skips(no_torch, capsys):
    assert main(["bench", "--sections", "layers", "--layer-tokens", "16", "--prefill-tokens", "0",
                 "--minilm-texts", "0", "--train-steps", "1", "--new-tokens", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch is not installed: attnlab's rows run alone" in out
    assert "pip install 'attnlab[test]'" in out
    mha = [line for line in out.splitlines() if line.startswith("MultiheadAttention(512, 8) fwd,")]
    assert len(mha) == 1 and " ms " in mha[0] and "attnlab alone" in mha[0]
    assert "SmolLM2 in transformers" not in out
