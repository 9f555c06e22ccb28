"""ZeRO-3's reduction: reduce-scatter in the reduce dtype, averaged in fp32
(docs/design.md section 5.1). On gloo an all-to-all plus a local sum (gloo's own
reduce-scatter is an all-reduce, twice the bytes); on NCCL its ring reduce-scatter."""

from __future__ import annotations

from .. import traffic
from ..traffic import Traffic
from ..topology import Layout
from .base import GradientReduction


class PlainReduction(GradientReduction):
    def start(self, flat_grad, label: str = ""):
        to_send = flat_grad.to(self.config.reduce_torch_dtype)
        return self.comm.reduce_scatter_mean(to_send, self.topology.group("world"), "reduce_scatter", label)

    def held_bytes(self, shard_numel: int, layout: Layout, backend: str = "gloo") -> int:
        """What is sent, the gradient in the reduce dtype [W * S], and what arrives: every
        rank's chunk on gloo (an all-to-all), one chunk on NCCL."""
        itemsize = self.config.reduce_torch_dtype.itemsize
        received = shard_numel * itemsize if backend == "nccl" else layout.world_size * shard_numel * itemsize
        return layout.world_size * shard_numel * itemsize + received

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, backend: str = "gloo") -> Traffic:
        chunk = shard_numel * self.config.reduce_torch_dtype.itemsize
        if backend == "nccl":
            return traffic.ring(layout, rank, traffic.world(layout), chunk)
        return traffic.exchange(layout, rank, traffic.world(layout), chunk)

    def collective_steps(self, layout: Layout) -> int:
        return layout.world_size - 1
