"""The two-hop gather: this node's shards exact inside the node, only the other nodes'
shards across nodes (docs/design.md section 4.3). With rank ``r = n * D + d`` and shard
``S`` values::

    hop 1  inside the node, compute dtype: the D shards of this node, exact
    hop 2  across nodes, among the ranks with local index d: shard (n', d) of every node n'
           (packed when qwZ is on)
    hop 3  inside the node, after hop 2: the other nodes' shards every local rank received

Each node's link then carries the W - D shards of the other nodes instead of the ring's
W - 1, and with qwZ only those are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import traffic
from ..traffic import Traffic
from ..quantization import dequantize
from ..topology import Layout
from .base import WeightGather
from .quantized import PackedShards


@dataclass
class _Pending:
    within_node: object | None  # hop 1's work
    across_nodes: object | None  # hop 2's work
    from_nodes: torch.Tensor  # [N, P]: row n' is shard (n', d), packed or compute dtype
    phase: str


class TwoHopGather(WeightGather):
    def __init__(self, config, topology=None, communicator=None) -> None:
        super().__init__(config, topology, communicator)
        self.packed = PackedShards(config) if config.quantized_weights else None

    def start(self, flat, phase: str) -> _Pending:
        """Hops 1 and 2 start together; hop 3 needs hop 2's result, so ``finish`` runs it."""
        nodes, per_node = self.topology.num_nodes, self.topology.ranks_per_node
        node_rows = flat.full_data.view(nodes, per_node * flat.shard_numel)  # [N, D * S]
        within_node = self.comm.all_gather(
            node_rows[self.topology.node], flat.compute_shard(), self.topology.group("intra_node"), phase, flat.name
        )
        payload = self.packed.get(flat) if self.packed else flat.compute_shard()
        from_nodes = payload.new_empty(nodes, payload.numel())  # [N, P]
        across = self.comm.all_gather(from_nodes.view(-1), payload, self.topology.group("inter_node"), phase, flat.name)
        return _Pending(within_node, across, from_nodes, phase)

    def finish(self, flat, pending: _Pending) -> torch.Tensor:
        self._wait(pending.across_nodes)
        if self.topology.num_nodes > 1:
            self._fill_other_nodes(flat, pending.from_nodes, pending.phase)
        self._wait(pending.within_node)
        return flat.full_data

    def _fill_other_nodes(self, flat, from_nodes: torch.Tensor, phase: str) -> None:
        """Hop 3: share what hop 2 brought (``from_nodes`` [N, P], row n is shard (n, d))
        with the other local ranks, and write every other node's shards into the buffer."""
        nodes, per_node, node = self.topology.num_nodes, self.topology.ranks_per_node, self.topology.node
        others = [n for n in range(nodes) if n != node]
        remote = from_nodes[others].view(-1)  # [(N - 1) * P]
        # [D, N - 1, P]: row d' holds the other nodes' shards at local index d'
        everyone = remote.new_empty(per_node, nodes - 1, from_nodes.shape[1])
        self._wait(self.comm.all_gather(everyone.view(-1), remote, self.topology.group("intra_node"), phase, flat.name))
        full = flat.full_data.view(nodes, per_node, flat.shard_numel)
        if self.packed is not None and nodes == 2:  # one other node: its rows are contiguous in the buffer
            dequantize(everyone.view(per_node, -1), self.packed.format, flat.shard_numel, out=full[others[0]])
            return
        if self.packed is not None:
            everyone = dequantize(everyone.view(per_node * (nodes - 1), -1), self.packed.format, flat.shard_numel)
        full[others] = everyone.view(per_node, nodes - 1, flat.shard_numel).transpose(0, 1).to(full.dtype)

    def invalidate(self, flat) -> None:
        if self.packed is not None:
            self.packed.invalidate(flat)

    def kept_bytes(self, shard_numel: int, layout: Layout) -> int:
        return self.chunk_bytes(shard_numel) if self.packed is not None else 0

    def receive_bytes(self, shard_numel: int, layout: Layout) -> int:
        return layout.num_nodes * self.chunk_bytes(shard_numel)  # one shard from each node

    def kept_tensors(self) -> list[torch.Tensor]:
        return self.packed.kept() if self.packed is not None else []

    def quantization_error_sums(self, flats) -> tuple[float, float]:
        if self.packed is None:
            return 0.0, 0.0
        error, norm = self.packed.error_sums(flats)
        # A shard reaches the ranks of its own node exact and the (N - 1) D others
        # quantized: averaged over ranks, (N - 1) / N of the error reaches the compute.
        nodes = self.topology.num_nodes
        return error * (nodes - 1) / nodes, norm

    def chunk_bytes(self, shard_numel: int) -> int:
        """The gathered buffer is mixed (exact and dequantized): kept in the compute dtype."""
        return shard_numel * self.compute_itemsize

    def _across_chunk_bytes(self, shard_numel: int) -> int:
        if self.packed is not None:
            return self.packed.format.packed_nbytes(shard_numel)
        return shard_numel * self.compute_itemsize

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        node_group, across = traffic.intra_node(layout, rank), self._across_chunk_bytes(shard_numel)
        hop1 = traffic.ring(layout, rank, node_group, shard_numel * self.compute_itemsize)
        hop2 = traffic.ring(layout, rank, traffic.inter_node(layout, rank), across)
        hop3 = traffic.ring(layout, rank, node_group, (layout.num_nodes - 1) * across) if layout.num_nodes > 1 else Traffic()
        return hop1 + hop2 + hop3

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return 2 * (layout.ranks_per_node - 1) + layout.num_nodes - 1
