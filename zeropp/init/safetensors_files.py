"""Reading byte ranges of tensors from safetensors files, so a rank reads only its shard.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and [begin, end) byte range after the header, then the raw
little-endian, row-major data: elements [first, last) of a flattened tensor are one
contiguous byte range. A Hugging Face sharded checkpoint adds ``model.safetensors.index.json``
whose ``weight_map`` names the file of each tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte position in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFiles:
    """The tensors of one safetensors file, a folder holding one, or a sharded index."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, TensorEntry] = {}
        self.bytes_read = 0  # data bytes read so far (headers excluded)
        for file in _files_of(self.path):
            self.entries.update(_read_header(file))

    def read(self, name: str, first: int, last: int) -> torch.Tensor:
        """Elements [first, last) of tensor ``name`` flattened, in its stored dtype."""
        entry = self.entries[name]
        size = entry.dtype.itemsize
        with open(entry.file, "rb") as handle:
            handle.seek(entry.begin + first * size)
            data = bytearray(handle.read((last - first) * size))
        self.bytes_read += len(data)
        if not data:
            return torch.empty(0, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=entry.dtype)


def _files_of(path: Path) -> list[Path]:
    if path.is_file() and path.name.endswith(".json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return sorted({path.parent / file for file in weight_map.values()})
    if path.is_file():
        return [path]
    if (path / INDEX_NAME).is_file():
        return _files_of(path / INDEX_NAME)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ValueError(f"no safetensors weights at {path}: give a .safetensors file, a folder holding "
                         f"them, or a {INDEX_NAME}")
    return files


def _read_header(file: Path) -> dict[str, TensorEntry]:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}; readable: {sorted(DTYPES)}")
        entries[name] = TensorEntry(file, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + info["data_offsets"][0])
    return entries
