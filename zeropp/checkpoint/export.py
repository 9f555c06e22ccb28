"""Consolidated export: one safetensors file that plain PyTorch loads into the unsharded
model, written parameter by parameter so peak memory stays near the largest parameter
rather than the whole model (let alone W copies of it).

safetensors layout: 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from .format import read_metadata, resolve_checkpoint
from .resharding import RankFiles, read_positions


def export_consolidated(checkpoint: str | Path, output: str | Path) -> Path:
    folder = resolve_checkpoint(checkpoint)
    metadata = read_metadata(folder)
    files = RankFiles(folder, metadata)
    entries = []  # (name, flat index, shard numel, offset, numel, shape), one per name
    for index, flat in enumerate(metadata["flats"]):
        for slot in flat["slots"]:
            for name in slot["names"]:  # tied weights appear under each of their names
                entries.append((name, index, flat["shard_numel"], slot["offset"], slot["numel"], slot["shape"]))
    entries.sort()
    layout = [(name, shape) for name, _, _, _, _, shape in entries]
    values = (read_positions(files, index, shard_numel, offset, offset + numel, "master")
              for _, index, shard_numel, offset, numel, _ in entries)
    return write_safetensors(output, layout, values, {"format": "pt", "zeropp_step": str(metadata["step"])})


def write_safetensors(output: str | Path, layout: list[tuple[str, list[int]]], values, metadata: dict) -> Path:
    """Write fp32 tensors named and shaped by ``layout`` whose values come one at a time, in
    that order, from ``values`` (so only one is in memory); atomically (a partial file never
    carries the final name)."""
    header, position = {}, 0
    for name, shape in layout:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [position, position + size]}
        position += size
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    output = Path(output)
    temporary = output.with_name(f".{output.name}.partial")
    with open(temporary, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for (name, shape), value in zip(layout, values, strict=True):
            assert value.numel() == math.prod(shape), name
            handle.write(value.detach().float().cpu().contiguous().numpy().tobytes())
    temporary.replace(output)
    return output


def model_bytes(metadata: dict) -> int:
    """fp32 bytes of the model's distinct parameters (tied weights once)."""
    return sum(4 * math.prod(slot["shape"]) for flat in metadata["flats"] for slot in flat["slots"])


def export_model(model, path: str | Path) -> Path | None:
    """Collective: a wrapped model's whole fp32 parameters and buffers as one safetensors
    file, written by rank 0 (None elsewhere); what ``LoadSafetensors`` reads back."""
    state = model.full_state_dict(rank0_only=True)
    if model.topology.rank != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    return write_safetensors(path, [(name, list(state[name].shape)) for name in names],
                             (state[name] for name in names), {"format": "pt"})
