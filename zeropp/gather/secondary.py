"""hpZ: a secondary partition of the weights inside each hpZ group of ``hpz_size``
consecutive ranks of a node, so that later gathers never cross nodes (docs/design.md
section 4.4). A wrapper over any primary gather.

After a gather from the primary shards, member j of the group keeps part j (of hpz_size)
of the gathered buffer as it travelled: the packed bytes when the primary gather is qwZ
(half the memory, and backward sees exactly the forward's weights), else compute-dtype
values. Until the master shard changes, the next gather of the flat is an all-gather of
those parts inside the group.
"""

from __future__ import annotations

import torch

from .. import traffic
from ..traffic import Traffic
from ..topology import Layout
from .base import WeightGather


class SecondaryGather(WeightGather):
    def __init__(self, primary: WeightGather, config, topology=None, communicator=None) -> None:
        super().__init__(config, topology, communicator)
        self.primary = primary
        self.size = config.hpz_size
        self.group = topology.hpz_group(self.size) if topology is not None else None
        self._parts: dict[str, torch.Tensor] = {}  # flat name -> this member's part of the gathered buffer

    def start(self, flat, phase: str):
        part = self._parts.get(flat.name)
        if part is None:
            return "primary", self.primary.start(flat, phase)
        # Unpacked parts gather straight into the full buffer; packed ones into a buffer of
        # the world's packed shards [W * P], dequantized by the primary in ``finish``.
        gathered = part.new_empty(self.size * part.numel()) if self.primary.keeps_packed else flat.full_data
        return "secondary", (self.comm.all_gather(gathered, part, self.group, phase, flat.name), gathered)

    def finish(self, flat, pending) -> torch.Tensor:
        source, inner = pending
        if source == "primary":
            gathered = self.primary.finish(flat, inner)
            self._parts[flat.name] = self._own_part(gathered)
            return gathered
        work, gathered = inner
        self._wait(work)
        if self.primary.keeps_packed:
            self.primary.fill_from_packed(flat, gathered)
        return gathered

    def _own_part(self, gathered: torch.Tensor) -> torch.Tensor:
        """Member j of the hpZ group keeps part j of ``gathered`` split in hpz_size parts."""
        member = self.group.ranks.index(self.topology.rank)
        part = gathered.numel() // self.size
        return gathered[member * part : (member + 1) * part].clone()

    def invalidate(self, flat) -> None:
        self.primary.invalidate(flat)
        self._parts.pop(flat.name, None)

    def forget(self, flat) -> None:
        self.primary.forget(flat)
        self._parts.pop(flat.name, None)

    def kept_tensors(self) -> list[torch.Tensor]:
        return list(self._parts.values()) + self.primary.kept_tensors()

    def kept_bytes(self, shard_numel: int, layout: Layout) -> int:
        """This member's part of the gathered buffer as it travelled, and the primary's cache."""
        if self.primary.keeps_packed:
            whole = layout.world_size * self.primary.chunk_bytes(shard_numel)
        else:
            whole = layout.world_size * shard_numel * self.primary.compute_itemsize
        return whole // self.size + self.primary.kept_bytes(shard_numel, layout)

    def receive_bytes(self, shard_numel: int, layout: Layout) -> int:
        return self.primary.receive_bytes(shard_numel, layout)  # the first gather's; the parts' is as large or smaller

    def holds_copy(self, flat) -> bool:
        return flat.name in self._parts

    def quantization_error_sums(self, flats) -> tuple[float, float]:
        return self.primary.quantization_error_sums(flats)

    @property
    def keeps_packed(self) -> bool:
        return self.primary.keeps_packed

    def chunk_bytes(self, shard_numel: int) -> int:
        return self.primary.chunk_bytes(shard_numel)

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        """Forward gathers from the primary shards (the last optimizer step dropped the
        parts); backward, right after, from the parts forward left."""
        if phase != "backward_gather":
            return self.primary.predicted_bytes(shard_numel, layout, rank, phase)
        first = rank // self.size * self.size
        part_bytes = self.primary.chunk_bytes(shard_numel) * layout.world_size // self.size
        return traffic.ring(layout, rank, list(range(first, first + self.size)), part_bytes)

    def collective_steps(self, layout: Layout, phase: str) -> int:
        if phase != "backward_gather":
            return self.primary.collective_steps(layout, phase)
        return self.size - 1
