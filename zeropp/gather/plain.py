"""ZeRO-3's gather: a ring all-gather of the compute-dtype shards over the world
(docs/design.md section 4.1)."""

from __future__ import annotations

import torch

from .. import traffic
from ..traffic import Traffic
from ..topology import Layout
from .base import WeightGather


class PlainGather(WeightGather):
    def start(self, flat, phase: str):
        return self.comm.all_gather(flat.full_data, flat.compute_shard(), self._world(), phase, flat.name)

    def finish(self, flat, pending) -> torch.Tensor:
        self._wait(pending)
        return flat.full_data

    def chunk_bytes(self, shard_numel: int) -> int:
        return shard_numel * self.compute_itemsize

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        return traffic.ring(layout, rank, traffic.world(layout), self.chunk_bytes(shard_numel))

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return layout.world_size - 1
