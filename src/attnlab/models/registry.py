"""The one registry of model families: what each family is, where its code lives and how to
recognise its files. The CLI, :mod:`attnlab.explain` and :mod:`attnlab.interop` ask it;
nothing else guesses a family from a folder.

A family is a config class, a weight-name map and one module of :mod:`attnlab.models`; its
entry here names them (imported only when the family is used) and says how to detect it:

- a Hugging Face folder by its ``config.json`` (``model_type``, else ``architectures``);
- a GGUF file by its ``general.architecture``;
- an attnlab checkpoint (``.npz``, written by ``attnlab train``) by its suffix.

>>> detect_config({"model_type": "gpt2"}).name
'gpt2'
>>> detect_config({"model_type": "t5"})
Traceback (most recent call last):
...
attnlab.io.files.CheckpointError: model_type 't5' is not a supported family; supported: ...
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.io import CheckpointError, read_json

__all__ = ["FAMILIES", "Family", "detect", "detect_config", "from_pretrained", "supported"]


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: the family's name (``"gpt2"``), as ``attnlab explain --model`` and the docs say it.
        module: the module of :mod:`attnlab.models` that arranges it.
        model: the model class's name in ``module``.
        config: the config class's name in ``module``.
        model_types: ``config.json`` ``model_type`` values it reads.
        architectures: ``transformers`` class names (``config.json`` ``architectures``, and
            the torch modules :func:`attnlab.interop.from_torch` takes).
        gguf_architectures: GGUF ``general.architecture`` values it reads.
        name_map: ``"module:function"`` giving the map from attnlab's parameter names to the
            checkpoint's.
        decoder: a causal language model (``generate`` works).
        files: what a folder of the family holds.
    """

    name: str
    module: str
    model: str
    config: str
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    name_map: str | None = None
    decoder: bool = True
    files: str = "config.json, model.safetensors, tokenizer.json"

    def model_class(self):
        """The model class (its module imported now)."""
        return getattr(importlib.import_module(self.module), self.model)

    def config_class(self):
        return getattr(importlib.import_module(self.module), self.config)

    def describe(self) -> str:
        kinds = ", ".join(self.architectures or self.model_types) or self.files
        return f"{self.name} ({kinds})"


#: Every family attnlab runs, by name. A new family adds one entry.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("bert", "attnlab.models.bert", "BertEncoder", "BertConfig", ("bert",),
               ("BertModel", "BertForMaskedLM", "BertForPreTraining"), name_map="attnlab.io.names:bert_name_map",
               decoder=False, files="config.json, model.safetensors, vocab.txt or tokenizer.json"),
        Family("gpt2", "attnlab.models.gpt2", "GPT2", "GPT2Config", ("gpt2",), ("GPT2LMHeadModel", "GPT2Model"),
               name_map="attnlab.io.names:gpt2_name_map"),
        Family("llama", "attnlab.models.llama", "Llama", "LlamaConfig", ("llama",), ("LlamaForCausalLM",),
               ("llama",), name_map="attnlab.models.llama:llama_name_map",
               files="config.json, model.safetensors (or a sharded index), tokenizer.json; or a .gguf file"),
        Family("mistral", "attnlab.models.llama", "Llama", "LlamaConfig", ("mistral",), ("MistralForCausalLM",),
               ("mistral",), name_map="attnlab.models.llama:llama_name_map"),
        Family("qwen2", "attnlab.models.llama", "Llama", "LlamaConfig", ("qwen2",), ("Qwen2ForCausalLM",),
               ("qwen2",), name_map="attnlab.models.llama:llama_name_map"),
        Family("qwen3", "attnlab.models.llama", "Llama", "LlamaConfig", ("qwen3",), ("Qwen3ForCausalLM",),
               ("qwen3",), name_map="attnlab.models.llama:llama_name_map"),
        Family("gemma2", "attnlab.models.gemma", "Gemma", "GemmaConfig", ("gemma2",), ("Gemma2ForCausalLM",),
               name_map="attnlab.models.gemma:gemma_name_map"),
        Family("gemma3", "attnlab.models.gemma", "Gemma", "GemmaConfig", ("gemma3_text",), ("Gemma3ForCausalLM",),
               name_map="attnlab.models.gemma:gemma_name_map"),
        Family("olmo2", "attnlab.models.olmo2", "Olmo2", "Olmo2Config", ("olmo2",), ("Olmo2ForCausalLM",),
               name_map="attnlab.models.olmo2:olmo2_name_map"),
        Family("phi3", "attnlab.models.phi3", "Phi3", "Phi3Config", ("phi3",), ("Phi3ForCausalLM",),
               name_map="attnlab.models.phi3:phi3_name_map"),
        Family("tiny", "attnlab.models.tiny", "TinyTransformer", "TinyTransformerConfig",
               files="an attnlab checkpoint (.npz, written by attnlab train)"),
    )
}
"""Every family attnlab runs, by name (``"bert"``, ``"gpt2"``, ``"llama"``, ``"mistral"``,
``"qwen2"``, ``"qwen3"``, ``"gemma2"``, ``"gemma3"``, ``"olmo2"``, ``"phi3"``, ``"tiny"``): its module, classes, the
``model_type`` and architectures it recognises and its weight-name map. A new family adds one
entry."""


def supported() -> str:
    """The supported families, for error messages."""
    return "; ".join(f.describe() for f in FAMILIES.values())


def detect_config(config: dict, where: str = "") -> Family:
    """The family of a ``config.json``'s contents (``model_type``, else ``architectures``)."""
    at = f"{where}: " if where else ""
    model_type = config.get("model_type")
    for f in FAMILIES.values():
        if model_type in f.model_types:
            return f
    archs = config.get("architectures") or []
    for f in FAMILIES.values():
        if any(a in f.architectures for a in archs if isinstance(a, str)):
            return f
    what = f"model_type {model_type!r}" + (f" (architectures {archs})" if archs else "")
    raise CheckpointError(f"{at}{what} is not a supported family; supported: {supported()}")


def detect(path: str | os.PathLike) -> Family:
    """The family of a model folder, a GGUF file or an attnlab checkpoint.

    Raises:
        FileNotFoundError: nothing at ``path``, or a folder without ``config.json``.
        CheckpointError: a family attnlab does not run (the supported ones are listed).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(2, "file not found (give a model folder, a .gguf file or a .npz checkpoint)", str(p))
    if p.is_file():
        if p.suffix == ".npz":
            return FAMILIES["tiny"]
        if p.suffix == ".gguf":
            from attnlab.io.gguf import read_gguf

            arch = read_gguf(p, tensors=False).architecture
            for f in FAMILIES.values():
                if arch in f.gguf_architectures:
                    return f
            raise CheckpointError(f"{p}: GGUF architecture {arch!r} is not a supported family; "
                                  f"supported: {supported()}")
        raise CheckpointError(f"{p} is neither a model folder, a .gguf file nor a .npz checkpoint")
    config = p / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{p} has no config.json (a model folder holds config.json and "
                                f"model.safetensors); supported: {supported()}")
    return detect_config(read_json(config), str(config))


def from_pretrained(path: str | os.PathLike, **kwargs):
    """The model in ``path``, of whichever family it is: a Hugging Face folder
    (``config.json``, weights, tokenizer), a ``.gguf`` file or an attnlab ``.npz``
    checkpoint (then the :class:`~attnlab.models.TinyTransformer` alone).

    Raises:
        FileNotFoundError, CheckpointError: as :func:`detect` and the family's loader.
    """
    family = detect(path)
    if family.name == "tiny":
        from attnlab.train.checkpoint import load_checkpoint

        return load_checkpoint(path)[0]
    return family.model_class().from_pretrained(path, **kwargs)
