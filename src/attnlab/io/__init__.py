"""Reading and writing model files: the one safetensors reader every model shares (header
validated before anything is allocated), checkpoint name maps, checked JSON configs and
sentence-transformers pipelines.

>>> sorted(bert_name_map(0))[:2]
['embeddings.ln.bias', 'embeddings.ln.weight']
"""

from attnlab.io.files import (
    CheckpointError,
    check_tokenizer,
    load_tokenizer,
    read_json,
    regular_file,
    safetensors_weights,
)
from attnlab.io.names import NameMap, bert_name_map, load_mapped, map_tensors
from attnlab.io.safetensors import TensorInfo, load_tensors, read_header, save_tensors
from attnlab.io.sentence_transformers import SentencePipeline, read_pipeline

__all__ = [
    "check_tokenizer",
    "load_tokenizer",
    "safetensors_weights",
    "CheckpointError",
    "NameMap",
    "SentencePipeline",
    "TensorInfo",
    "bert_name_map",
    "load_mapped",
    "load_tensors",
    "map_tensors",
    "read_header",
    "read_json",
    "read_pipeline",
    "regular_file",
    "save_tensors",
]
