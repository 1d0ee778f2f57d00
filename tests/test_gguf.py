"""GGUF files through the gguf package: SmolLM2's tensors, config, tokenizer and chat
template against transformers on the same file; tiny random files of each architecture
(q/k rows permuted as llama.cpp writes them); files that lie about their contents."""

from __future__ import annotations

import shutil
import struct
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("gguf")

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.io.gguf import _metadata, _open, gguf_name, read_gguf, unpermute_qk_rows  # noqa: E402
from gguf_files import TEMPLATE, permute_qk_rows, write_tiny_gguf  # noqa: E402

TEXTS = [
    "What is the capital of France?",
    "Hello world, it's me!  Don't   panic.\n\n\tTabs\tand\r\nnewlines",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "数字 123456789 émoji 🤖🚀 naïve café Ünïcödé",
    "def f(x):\n    return x ** 2  # comment\n",
    "    leading spaces and trailing spaces    ",
    "URLs: https://example.com/a?b=c&d=e#frag, emails a.b@c.de",
    "1234567890 3.14159 -42 1e-5 0x1F",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "",
    " ",
    "<|endoftext|><|endoftext|>",
    "Mixed<|im_end|>special tokens<|im_start|> inside",
    "'s 't 're 've 'm 'll 'd I'M YOU'RE",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
]


# ---- SmolLM2 --------------------------------------------------------------------------
def test_smollm2_tensors_equal_transformers(smollm2_gguf, hf_smollm2):
    model, _ = hf_smollm2
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = smollm2_gguf.tensors
    assert set(sd) - set(ours) == {"lm_head.weight"}  # tied: the embedding
    assert set(ours) <= set(sd)
    worst = max(float(np.abs(ours[k] - sd[k]).max()) for k in ours)
    assert worst == 0.0
    assert all(a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous for a in ours.values())


def test_smollm2_config(smollm2_gguf, hf_smollm2):
    c = smollm2_gguf.config
    hf = hf_smollm2[0].config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings", "head_dim", "tie_word_embeddings"):
        assert c[key] == getattr(hf, key), key
    assert c["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert c["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (9, 3)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["eos_token_id"] == 2


def test_smollm2_tokenizer_equals_transformers(smollm2_gguf, hf_smollm2):
    _, hf_tok = hf_smollm2
    tok = smollm2_gguf.tokenizer()
    rng = np.random.default_rng(0)
    vocab = [t for t in smollm2_gguf.metadata["tokenizer.ggml.tokens"] if not t.startswith("<")]
    texts = TEXTS + ["".join(rng.choice(list(" abcXYZ019.,!?é\n'"), size=40)) for _ in range(20)]
    texts += [hf_tok.decode(rng.integers(0, len(vocab), 30).tolist()) for _ in range(10)]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids), text


def test_smollm2_chat_template_equals_transformers(smollm2_gguf, hf_smollm2):
    from attnlab.text.chat import ChatTemplate

    _, hf_tok = hf_smollm2
    template = ChatTemplate(smollm2_gguf.chat_template)
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "émoji 🤖 and <b>html</b>"}],
    ]
    for chat in chats:
        for gen in (False, True):
            want = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert template.render(chat, add_generation_prompt=gen) == want


# ---- tiny files of each architecture ----------------------------------------------------
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {"qtype": "Q8_0"}),
    ("llama", {"qtype": "F16", "tied": False}),
    ("qwen2", {"qtype": "Q4_1", "bias": True}),
])
def test_tiny_files_equal_transformers(tmp_path, arch, options):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = tmp_path / "m.gguf"
    written = write_tiny_gguf(path, arch=arch, **options)
    ours = read_gguf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    sd = hf.state_dict()
    assert set(ours.tensors) == set(written)
    for name, w in ours.tensors.items():
        np.testing.assert_array_equal(w, sd[name].numpy(), err_msg=name)
        assert np.abs(w - written[name]).max() <= 0.1 * np.abs(written[name]).max(), name  # quantization only
    assert ours.config["model_type"] == arch
    assert ours.config["tie_word_embeddings"] == options.get("tied", True)
    assert ours.config["attention_bias"] == options.get("bias", False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_files_read_back_exactly(tmp_path, arch):
    """F32 tensors round-trip bit for bit: llama's q/k rows are unpermuted, qwen3's are not
    permuted at all and its QK-norm weights are read."""
    path = tmp_path / "m.gguf"
    written = write_tiny_gguf(path, arch=arch, qtype="F32", qk_norm=arch == "qwen3", bias=True, heads=4, kv_heads=1)
    ours = read_gguf(path)
    assert set(ours.tensors) == set(written)
    for name, w in written.items():
        np.testing.assert_array_equal(ours.tensors[name], w, err_msg=name)
    assert ours.config["head_dim"] == 8 and ours.config["num_key_value_heads"] == 1
    assert "model.layers.0.self_attn.q_norm.weight" in ours.tensors or arch == "llama"


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, D in [(1, 2), (3, 8), (4, 64)]:
        w = rng.standard_normal((heads * D, 5))
        np.testing.assert_array_equal(unpermute_qk_rows(permute_qk_rows(w, heads), heads), w)
        b = rng.standard_normal(heads * D)
        np.testing.assert_array_equal(unpermute_qk_rows(permute_qk_rows(b, heads), heads), b)
    assert gguf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert gguf_name("blk.0.unknown.weight") is None


def test_tiny_tokenizer_and_template(tmp_path):
    from attnlab.text.chat import apply_chat_template

    path = tmp_path / "m.gguf"
    write_tiny_gguf(path)
    g = read_gguf(path, tensors=False)
    assert g.tensors == {} and g.config["num_hidden_layers"] == 2 and g.architecture == "llama"
    tok = g.tokenizer()
    ids = tok.encode("hello world<|im_end|>").ids
    names = g.metadata["tokenizer.ggml.tokens"]
    assert [names[i] for i in ids][:1] == ["hello"] and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == "hello world<|im_end|>"
    assert g.chat_template == TEMPLATE
    text = apply_chat_template(g.chat_template, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---- files that lie -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, layers=1)
    return path


def corrupt(src, dst, offset, fmt, value):
    shutil.copy(src, dst)
    with open(dst, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))
    return dst


def refuses(path, match):
    """read_gguf(path) raises a CheckpointError naming the file and matching ``match``, and
    allocates little on the way (the claimed sizes are never allocated)."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=match) as info:
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value)
    assert peak < 20 << 20, peak


def test_truncated_file_is_refused(tiny_file, tmp_path):
    data = tiny_file.read_bytes()
    for cut in (10, 40, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        refuses(path, "truncated or corrupt|not a valid GGUF")


def test_header_claiming_too_many_tensors_or_entries(tiny_file, tmp_path):
    refuses(corrupt(tiny_file, tmp_path / "t.gguf", 8, "<Q", 10**12), r"claims 1000000000000 tensors")
    refuses(corrupt(tiny_file, tmp_path / "k.gguf", 16, "<Q", 10**15), r"claims 1000000000000000 metadata entries")


def test_string_and_array_longer_than_the_file(tiny_file, tmp_path):
    refuses(corrupt(tiny_file, tmp_path / "s.gguf", 24, "<Q", 2**40), r"past the end of the file")
    from gguf import GGUFReader

    reader = GGUFReader(tiny_file)
    field = reader.fields["tokenizer.ggml.tokens"]
    length_at = field.offset + sum(int(p.nbytes) for p in field.parts[:3]) + 4  # key len, key, type, item type
    assert int(np.frombuffer(tiny_file.read_bytes()[length_at:length_at + 8], "<u8")[0]) == len(field.data)
    refuses(corrupt(tiny_file, tmp_path / "a.gguf", length_at, "<Q", 10**13), r"claims 10000000000000 items")


def test_metadata_reads_as_the_gguf_packages_reader_reads_it(tiny_file, tmp_path):
    """attnlab reads arrays in one go (numbers as one view, strings in one loop): every
    entry, arrays of strings, integers and floats and empty ones included, equals what the
    gguf package's own reader gives, value and type."""
    import gguf

    path = tmp_path / "arrays.gguf"
    shutil.copy(tiny_file, path)
    w = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.strings", ["", "é", "a b"])
    w.add_array("test.bools", [True, False])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    # an empty array of strings (GGUFWriter skips empty arrays): one more entry after the last
    data = (tmp_path / "extra.gguf").read_bytes()
    last = list(gguf.GGUFReader(tmp_path / "extra.gguf").fields.values())[-1]
    end = last.offset + sum(int(p.nbytes) for p in last.parts)
    key = b"test.empty"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY,
                                                            gguf.GGUFValueType.STRING, 0)
    count = struct.unpack_from("<Q", data, 16)[0]
    (tmp_path / "extra.gguf").write_bytes(data[:16] + struct.pack("<Q", count + 1) + data[24:end] + entry
                                          + data[end:])
    for file in (tiny_file, tmp_path / "extra.gguf"):
        ours = _metadata(_open(file), file)
        theirs = {k: f.contents() for k, f in gguf.GGUFReader(file).fields.items() if not k.startswith("GGUF.")}
        assert ours == theirs
        assert [type(x) for v in ours.values() if isinstance(v, list) for x in v] == \
            [type(x) for v in theirs.values() if isinstance(v, list) for x in v]
    assert ours["test.strings"] == ["", "é", "a b"] and ours["test.floats"] == [0.5, -1.25, 3.0]
    assert ours["test.bools"] == [True, False] and ours["test.empty"] == []
    assert len(_metadata(_open(tiny_file), tiny_file)["tokenizer.ggml.tokens"]) > 10


def test_a_string_inside_an_array_longer_than_the_file(tiny_file, tmp_path):
    from gguf import GGUFReader

    field = GGUFReader(tiny_file).fields["tokenizer.ggml.merges"]
    first = field.offset + sum(int(p.nbytes) for p in field.parts[:5])  # key, type, item type, count
    assert bytes(field.parts[6]) == tiny_file.read_bytes()[first + 8:first + 8 + len(field.parts[6])]
    refuses(corrupt(tiny_file, tmp_path / "m.gguf", first, "<Q", 2**40),
            r"claims a string of 1099511627776 bytes at byte \d+, past the end of the file")


def test_tensor_offset_past_the_end(tiny_file, tmp_path):
    from gguf import GGUFReader

    t = GGUFReader(tiny_file).tensors[0]
    at = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:-1])
    refuses(corrupt(tiny_file, tmp_path / "o.gguf", at, "<Q", 10**12), r"past the end of the file")


def test_not_gguf_and_unsupported_architecture(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    refuses(path, "not a valid GGUF file")
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(CheckpointError, match=r"architecture 'gpt2' is not supported; supported: llama, mistral, "
                                              r"qwen2, qwen3"):
        read_gguf(tmp_path / "gpt2.gguf")


def test_unsupported_quantization_type_is_named(tmp_path):
    import gguf

    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((8, 32 // block * size), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(CheckpointError, match=r"token_embd.weight is stored as Q8_1, a type attnlab cannot "
                                              r"dequantize; supported: .*Q4_1"):
        read_gguf(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        read_gguf(tmp_path / "none.gguf")
    with pytest.raises(CheckpointError, match="is a directory"):
        read_gguf(tmp_path)


# ---- chat templates in the sandbox ------------------------------------------------------
@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
    "{{ messages.append(1) }}",
    "{{ cycler.__init__.__globals__.os }}",
])
def test_chat_template_cannot_reach_python_internals(source):
    from attnlab.text.chat import ChatTemplate

    with pytest.raises(ValueError, match="the chat template tried something the sandbox forbids"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_chat_template_errors_are_one_clear_value_error():
    from attnlab.text.chat import ChatTemplate, apply_chat_template

    with pytest.raises(ValueError, match="the chat template failed: Only user and assistant roles"):
        apply_chat_template("{{ raise_exception('Only user and assistant roles') }}", [])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ValueError, match="failed"):
        apply_chat_template("{{ 1 / 0 }}", [])
    with pytest.raises(TypeError, match="messages"):
        apply_chat_template("x", "not a list")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from attnlab.text import chat

    assert isinstance(chat._environment(), ImmutableSandboxedEnvironment)
    text = apply_chat_template("{{ messages | tojson }}{{ x.y }} {{ x.z }}", [{"role": "user", "content": "é"}],
                               x={"y": np.float32(1.5), "z": np.zeros(2)})
    assert text == '[{"role": "user", "content": "é"}]1.5 <ndarray>'


@pytest.mark.parametrize(("key", "value", "match"), [
    ("attention.head_count", 0, "num_attention_heads must be a positive integer, got 0"),
    ("attention.head_count", 3, r"num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ("attention.head_count", 8, r"tensor blk.0.attn_q.weight has shape \(32, 32\), but the config's "
                                r"\(num_attention_heads x head_dim, hidden_size\) is \(64, 32\)"),
    ("embedding_length", "wide", "hidden_size must be a positive integer, got 'wide'"),
])
def test_metadata_that_does_not_fit_is_refused(tmp_path, key, value, match):
    """Metadata with a bad head count or width: a CheckpointError naming the file."""
    import gguf

    src = tmp_path / "src.gguf"
    write_tiny_gguf(src, layers=1, qtype="F32")
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = field.contents()
        if name == f"llama.{key}":
            v = value
        kind = gguf.GGUFValueType.STRING if isinstance(v, str) else field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, v, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(name, v, kind)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(CheckpointError, match=match) as info:
        read_gguf(tmp_path / "bad.gguf")
    assert "bad.gguf" in str(info.value)


def test_sentencepiece_vocabulary_equals_transformers(tmp_path):
    """A sentencepiece ('llama' model) vocabulary with scores and byte pieces, no merges
    (Llama 2, Mistral and TinyLlama files): the merges recovered from the scores, byte
    fallback, the leading '▁' and the BOS token, as transformers' GGUF tokenizer."""
    import gguf

    transformers = pytest.importorskip("transformers")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "e", "l", "o", "h", "w", "r", "d", "t", "a", "n", "s", "▁h", "▁w", "he", "ll", "▁he", "▁hell",
             "▁hello", "▁wo", "▁wor", "▁worl", "▁world", "th", "▁th", "▁the", "an", "▁an", "▁and", "in", "▁in", "er",
             "st", "at", "▁a", "▁t", "▁s", ",", ".", "!", "ld", "or", "▁st"]
    tokens = pieces + words
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(pieces) + [-float(i % 17) for i in range(len(words))])  # ties too
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    ours = read_gguf(path, tensors=False).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    rng = np.random.default_rng(0)
    texts = ["hello world", " hello  world!", "the and in, a st.", "Héllo wörld 🤖", "\nhello\n\tworld", "",
             "hellothe", "<s>hello</s>", "  leading", "trailing  "]
    texts += ["".join(rng.choice(list("helowrdtans ,.!é\n"), size=30)) for _ in range(30)]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
