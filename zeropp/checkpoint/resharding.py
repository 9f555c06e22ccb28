"""Mapping values between two sharded layouts by parameter name.

A checkpoint records, per flat buffer, where each parameter lives (offset, numel) and how
long each rank's shard is. Loading into another world size, alignment or rank count reads,
for each slice of the new shard, exactly the byte ranges of the old rank files that hold
it: memory stays near one shard, whatever the number of old ranks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .format import CheckpointError, rank_file_name, verify_file


def describe_flats(flats) -> list[dict]:
    return [
        {
            "name": flat.name,
            "requires_grad": flat.requires_grad,
            "shard_numel": flat.shard_numel,
            "padded_numel": flat.padded_numel,
            "slots": [
                {"names": list(slot.names), "shape": list(slot.shape), "offset": slot.offset, "numel": slot.numel}
                for slot in flat.slots
            ],
        }
        for flat in flats
    ]


def parameter_shapes(flats: list[dict]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(slot["shape"]) for flat in flats for slot in flat["slots"] for name in slot["names"]}


def check_compatible(saved: list[dict], model_flats) -> None:
    """Same parameter names and shapes; otherwise name what differs."""
    expected = parameter_shapes(saved)
    actual = parameter_shapes(describe_flats(model_flats))
    missing = sorted(set(actual) - set(expected))
    unexpected = sorted(set(expected) - set(actual))
    mismatched = sorted(f"{n}: checkpoint {expected[n]} vs model {actual[n]}" for n in set(actual) & set(expected) if expected[n] != actual[n])
    if missing or unexpected or mismatched:
        raise CheckpointError(
            "checkpoint does not fit this model: "
            f"missing from checkpoint {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            f"not in model {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}; "
            f"shape differs {mismatched[:8]}"
        )


class RankFiles:
    """Lazily opened, verified rank files of one checkpoint."""

    def __init__(self, folder: Path, metadata: dict) -> None:
        self.folder = folder
        self.metadata = metadata
        self._handles: dict[int, object] = {}

    def handle(self, rank: int):
        if rank not in self._handles:
            path = verify_file(self.folder, rank_file_name(rank), self.metadata)
            self._handles[rank] = safe_open(str(path), framework="pt")
        return self._handles[rank]

    def keys(self, rank: int) -> set[str]:
        return set(self.handle(rank).keys())

    def read(self, rank: int, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        handle = self.handle(rank)
        if start is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[start:stop]


def read_positions(files: RankFiles, flat_index: int, shard_numel: int, start: int, stop: int, key: str) -> torch.Tensor:
    """Values at positions [start, stop) of saved flat ``flat_index``, across rank files."""
    pieces = []
    position = start
    while position < stop:
        rank = position // shard_numel
        end = min(stop, (rank + 1) * shard_numel)
        pieces.append(files.read(rank, f"{flat_index}.{key}", position - rank * shard_numel, end - rank * shard_numel))
        position = end
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def assemble_shard(flat, rank: int, saved: list[dict], files: RankFiles, key: str) -> torch.Tensor:
    """This rank's shard [shard_numel] fp32 of ``flat`` in the new layout, built from the
    saved layout's ``key`` ("master" or "state.<name>"); padding stays zero."""
    where = {}
    for index, saved_flat in enumerate(saved):
        for slot in saved_flat["slots"]:
            for name in slot["names"]:
                where[name] = (index, saved_flat["shard_numel"], slot["offset"])
    shard = torch.zeros(flat.shard_numel, dtype=torch.float32)
    low, high = rank * flat.shard_numel, (rank + 1) * flat.shard_numel
    for slot in flat.slots:
        first, last = max(low, slot.offset), min(high, slot.offset + slot.numel)
        if first >= last:
            continue
        index, saved_shard_numel, saved_offset = where[slot.names[0]]
        begin = saved_offset + first - slot.offset
        shard[first - low : last - low] = read_positions(
            files, index, saved_shard_numel, begin, begin + last - first, key
        )
    return shard
