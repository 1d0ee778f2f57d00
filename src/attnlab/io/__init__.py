"""Reading and writing model files: the one safetensors reader every model shares (header
validated before anything is allocated), checkpoint name maps, checked JSON configs.

>>> sorted(bert_name_map(0))[:2]
['embeddings.ln.bias', 'embeddings.ln.weight']
"""

from attnlab.io.files import CheckpointError, read_json, regular_file
from attnlab.io.names import NameMap, bert_name_map, load_mapped, map_tensors
from attnlab.io.safetensors import TensorInfo, load_tensors, read_header, save_tensors

__all__ = [
    "CheckpointError",
    "NameMap",
    "TensorInfo",
    "bert_name_map",
    "load_mapped",
    "load_tensors",
    "map_tensors",
    "read_header",
    "read_json",
    "regular_file",
    "save_tensors",
]
