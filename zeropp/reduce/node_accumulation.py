"""Gradient accumulation that crosses nodes once per optimizer step (docs/design.md section 5.3).

While gradient sync is off (``model.no_sync()``, ``set_requires_gradient_sync(False)``),
a unit's local gradient g [W * S] is reduced inside the node only. With ``p = n * D + d``
the partition of rank p::

    swizzle   g[n, d, :] -> rows[d, n, :]      row d: the shards of local index d, one per node
    hop 1     all-to-all inside the node: local rank d receives every member's row d
              [D, N, S], sums them in fp32 into its buffer [N, S], kept across micro-steps

so each rank holds the node's sum of N shards (M / D values, not M / W). The micro-step
with sync on does hop 1 the same way and then::

    hop 2     all-to-all across nodes over the ranks of local index d: row n of the buffer
              goes to node n (in the reduce dtype, or qgZ's inter-node format); the N rows
              received [N, S] are summed in fp32 and divided by W

which is this rank's mean shard over every micro-step, as a reduce-scatter per micro-step
would have added up. Hop 2 launches when hop 1 has arrived, at a point that differs between
ranks, so it runs on a side group of its own (as qgZ's inter-node hop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import traffic
from ..traffic import Traffic

if TYPE_CHECKING:
    from ..collectives import Communicator
    from ..topology import Layout
    from .qgz import QgzReduction
    from ..sharding import FlatParam
    from ..topology import Topology

PHASE = "reduce_scatter"


class NodeAccumulation:
    def __init__(self, topology: "Topology", communicator: "Communicator", reduce_dtype: torch.dtype) -> None:
        self.topology = topology
        self.comm = communicator
        self.reduce_dtype = reduce_dtype
        self.buffers: dict[str, torch.Tensor] = {}  # flat name -> this rank's node sums [N, S] fp32
        self.inter_group = topology.side_group("inter_node", "accumulation") if topology.num_nodes > 1 else None

    def holds(self, flat: "FlatParam") -> bool:
        """Whether ``flat`` has node sums from micro-steps without sync."""
        return flat.name in self.buffers

    def start(self, flat: "FlatParam", grad: torch.Tensor, final: bool,
              quantized_hop: "QgzReduction | None" = None) -> "NodeReduction":
        """Hop 1 of ``grad`` [W * S]; with ``final`` hop 2 follows and ``wait()`` gives the
        mean shard [S] fp32 (and the buffer is released), else ``wait()`` gives None.
        ``quantized_hop`` (the qgZ reduction in force): hop 2 carries its inter-node format
        (codes and scales per block of each row) instead of reduce-dtype values; its other
        options (error feedback, Hadamard, stochastic rounding) apply to the per-micro-step
        path only."""
        return NodeReduction(self, flat, grad, final, quantized_hop)

    def has_sums(self) -> bool:
        """Whether micro-steps without sync left node sums to send."""
        return bool(self.buffers)

    def buffer_for(self, flat: "FlatParam") -> torch.Tensor:
        if flat.name not in self.buffers:
            self.buffers[flat.name] = torch.zeros(self.topology.num_nodes, flat.shard_numel, dtype=torch.float32,
                                                  device=flat.master.device)
        return self.buffers[flat.name]

    def clear(self) -> None:
        """Drop the node sums (the caller threw the accumulated gradients away)."""
        self.buffers.clear()


def predicted_bytes(shard_numel: int, layout: "Layout", rank: int, micro_steps: int, reduce_dtype: torch.dtype,
                    quantized_hop: "QgzReduction | None" = None) -> Traffic:
    """Bytes ``rank`` receives to reduce one flat over an optimizer step of ``micro_steps``:
    hop 1 in every micro-step, hop 2 once."""
    nodes = layout.num_nodes
    hop_1 = traffic.exchange(layout, rank, traffic.intra_node(layout, rank), nodes * shard_numel * reduce_dtype.itemsize)
    row = (quantized_hop.packed_nbytes(quantized_hop.inter_format, shard_numel) if quantized_hop is not None
           else shard_numel * reduce_dtype.itemsize)
    hop_2 = traffic.exchange(layout, rank, traffic.inter_node(layout, rank), row)
    total = hop_2
    for _ in range(micro_steps):
        total = total + hop_1
    return total


def held_bytes(shard_numel: int, layout: "Layout", reduce_dtype: torch.dtype) -> int:
    """Bytes one reduction in flight holds at most: hop 1's rows sent and received [D, N, S]
    in the reduce dtype (qgZ does not quantize hop 1). Hop 2 starts once they are released
    and sends the node sums themselves (counted apart) or their qgZ codes, receiving as much."""
    return 2 * layout.world_size * shard_numel * reduce_dtype.itemsize



class NodeReduction:
    """One unit's gradient in flight: hop 1, and hop 2 when final (``progress``/``wait`` as
    every reduction in flight)."""

    def __init__(self, accumulation: NodeAccumulation, flat: "FlatParam", grad: torch.Tensor, final: bool,
                 quantized_hop: "QgzReduction | None") -> None:
        topology = accumulation.topology
        self.accumulation, self.flat, self.final = accumulation, flat, final
        self.quantized_hop = quantized_hop
        accumulation.buffer_for(flat)  # from the start: a later micro-step must see it held
        nodes, per_node = topology.num_nodes, topology.ranks_per_node
        rows = grad.to(accumulation.reduce_dtype).view(nodes, per_node, -1).transpose(0, 1).contiguous()  # [D, N, S]
        self.received = torch.empty_like(rows)
        self.intra = accumulation.comm.all_to_all(self.received, rows, topology.group("intra_node"), PHASE, flat.name)
        self.inter = None  # (work, received [N, S]) once hop 2 is launched
        self.summed = False

    def _sum_node(self) -> None:
        if self.intra is not None:
            self.intra.wait()
            self.intra = None  # the work holds the rows it sent [D, N, S] until dropped
        buffer = self.accumulation.buffer_for(self.flat)
        buffer += self.received.sum(dim=0, dtype=torch.float32)
        self.received = None
        self.summed = True

    def _start_inter(self) -> None:
        buffer = self.accumulation.buffers.pop(self.flat.name)  # [N, S] fp32
        if self.accumulation.inter_group is None:
            self.inter = (None, buffer)
            return
        quantized = self.quantized_hop
        if quantized is not None:
            payload = quantized.quantize(buffer, quantized.inter_format)  # [N, packed row bytes]
        else:
            payload = buffer.to(self.accumulation.reduce_dtype)
        incoming = torch.empty_like(payload)
        work = self.accumulation.comm.all_to_all(incoming, payload, self.accumulation.inter_group, PHASE, self.flat.name)
        self.inter = (work, incoming)

    def _rows_received(self, incoming: torch.Tensor) -> torch.Tensor:
        """[N, S] values from what hop 2 brought."""
        quantized = self.quantized_hop
        if quantized is None or self.accumulation.inter_group is None:
            return incoming
        return quantized.dequantize(incoming, quantized.inter_format, self.flat.shard_numel)

    def progress(self) -> bool:
        """Launch hop 2 once hop 1 has arrived; True when nothing is left to launch."""
        if not self.final or self.inter is not None:
            return True
        if self.intra is not None and not self.intra.is_completed():
            return False
        self._sum_node()
        self._start_inter()
        return True

    def release(self) -> bool:
        """Wait for hop 1 and launch hop 2; True if hop 2 is now all that is left."""
        if not self.final:
            return False
        if self.inter is None:
            self._sum_node()
            self._start_inter()
        return True

    def wait(self) -> torch.Tensor | None:
        if not self.summed:
            self._sum_node()
        if not self.final:
            return None
        if self.inter is None:
            self._start_inter()
        work, incoming = self.inter
        if work is not None:
            work.wait()
        return self._rows_received(incoming).sum(dim=0, dtype=torch.float32).div_(self.accumulation.topology.world_size)
