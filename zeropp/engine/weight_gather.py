"""How a unit's weights are gathered: plain, quantized (qwZ), from the secondary partition
inside the hpZ group (hpZ), or in two hops (DESIGN.md sections 3-4).

qwZ quantizes the fp32 master shard once per optimizer step and reuses the packed shard
for every gather until the weights change. hpZ keeps, after a gather from the primary
shards, this rank's part of the hpZ group's split of the gathered buffer: the packed bytes
when every gathered shard was quantized (half the memory, and backward sees exactly the
forward's weights), else the compute-dtype values. Later gathers of the unit then stay
inside the hpZ group.

The hierarchical gather (``hierarchical_weight_gather``) replaces the ring over all W ranks
by three gathers. With rank ``r = n * D + d`` and shard ``S`` values::

    hop 1  inside the node, compute dtype: the D shards of this node, exact
    hop 2  across nodes, among the ranks with local index d: shard (n', d) of every node n'
           (packed when qwZ is on)
    hop 3  inside the node, after hop 2: the other nodes' shards every local rank received

Each node's link then carries the W - D shards of the other nodes instead of the ring's
W - 1, and with qwZ only those are quantized: this node's shards stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import Communicator
from ..config import ZeroConfig
from ..quantization import dequantize, quantizer
from ..sharding import FlatParam
from ..topology import Topology


@dataclass
class PendingGather:
    work: object | None
    packed: torch.Tensor | None  # [W * packed shard bytes] uint8 when every shard arrives packed
    from_primary: bool
    # hierarchical gather: hop 2's work and its buffer [N, shard payload], and hop 1's work
    across_nodes: tuple[object | None, torch.Tensor] | None = None
    within_node: object | None = None
    phase: str = ""


class WeightGather:
    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config = config
        self.comm = communicator
        self.topology = topology
        self.world = topology.group("world")
        self.hpz = topology.hpz_group(config.hpz_size) if config.hpz_size > 1 else None
        self.format = config.weight_format if config.quantized_weights else None
        self.hierarchical = config.hierarchical_weight_gather
        self.quantize = quantizer(config.compile_quantization)

    def use_formats(self, config: ZeroConfig) -> None:
        """Gather in ``config``'s weight format from now on (the caller dropped packed copies)."""
        self.config = config
        self.format = config.weight_format if config.quantized_weights else None

    def start(self, flat: FlatParam, phase: str) -> PendingGather:
        """Begin filling ``flat.full``; the caller has allocated its storage."""
        use_secondary = self.hpz is not None and flat.secondary is not None
        if not use_secondary and self.hierarchical:
            return self._start_hierarchical(flat, phase)
        group = self.hpz if use_secondary else self.world
        payload = flat.secondary if use_secondary else self._primary_payload(flat)
        if self.format is None or (use_secondary and self.hierarchical):
            work = self.comm.all_gather(flat.full_data, payload, group, phase, flat.name)
            return PendingGather(work, None, not use_secondary)
        packed = torch.empty(
            self.world.size * self.format.packed_nbytes(flat.shard_numel), dtype=torch.uint8, device=payload.device
        )
        work = self.comm.all_gather(packed, payload, group, phase, flat.name)
        return PendingGather(work, packed, not use_secondary)

    def finish(self, flat: FlatParam, pending: PendingGather) -> None:
        if pending.across_nodes is not None:
            self._finish_hierarchical(flat, pending)
        else:
            if pending.work is not None:
                pending.work.wait()
            if pending.packed is not None:
                rows = pending.packed.view(self.world.size, -1)  # one packed shard per rank
                # Dequantized in fp32; the copy rounds to the compute dtype in the same pass.
                flat.full_data.view(self.world.size, -1).copy_(dequantize(rows, self.format, flat.shard_numel))
        if self.hpz is not None and pending.from_primary:
            kept = pending.packed if pending.packed is not None else flat.full_data
            flat.secondary = self._secondary_part(kept)

    def _start_hierarchical(self, flat: FlatParam, phase: str) -> PendingGather:
        """Hops 1 and 2 start together; hop 3 needs hop 2's result, so ``finish`` runs it."""
        nodes, per_node = self.topology.num_nodes, self.topology.ranks_per_node
        node_rows = flat.full_data.view(nodes, per_node * flat.shard_numel)  # [N, D * S]
        within_node = self.comm.all_gather(
            node_rows[self.topology.node], flat.compute_shard(), self.topology.group("intra_node"), phase, flat.name
        )
        payload = self._primary_payload(flat)
        from_nodes = torch.empty(nodes, payload.numel(), dtype=payload.dtype, device=payload.device)  # [N, P]
        work = self.comm.all_gather(from_nodes.view(-1), payload, self.topology.group("inter_node"), phase, flat.name)
        return PendingGather(None, None, True, across_nodes=(work, from_nodes), within_node=within_node, phase=phase)

    def _finish_hierarchical(self, flat: FlatParam, pending: PendingGather) -> None:
        work, from_nodes = pending.across_nodes
        if work is not None:
            work.wait()
        if self.topology.num_nodes > 1:
            self._fill_other_nodes(flat, from_nodes, pending.phase)
        if pending.within_node is not None:
            pending.within_node.wait()

    def _fill_other_nodes(self, flat: FlatParam, from_nodes: torch.Tensor, phase: str) -> None:
        """Hop 3: share what hop 2 brought (``from_nodes`` [N, P], row n is shard (n, d))
        with the other local ranks, and write every other node's shards into the buffer."""
        nodes, per_node, node = self.topology.num_nodes, self.topology.ranks_per_node, self.topology.node
        others = [n for n in range(nodes) if n != node]
        remote = from_nodes[others].view(-1)  # [(N - 1) * P]
        # [D, N - 1, P]: row d' holds the other nodes' shards at local index d'
        everyone = remote.new_empty(per_node, nodes - 1, from_nodes.shape[1])
        work = self.comm.all_gather(everyone.view(-1), remote, self.topology.group("intra_node"), phase, flat.name)
        if work is not None:
            work.wait()
        if self.format is not None:
            everyone = dequantize(everyone.view(per_node * (nodes - 1), -1), self.format, flat.shard_numel)
        full = flat.full_data.view(nodes, per_node, flat.shard_numel)
        full[others] = everyone.view(per_node, nodes - 1, flat.shard_numel).transpose(0, 1).to(full.dtype)

    def quantization_error_sums(self, flats: list[FlatParam]) -> tuple[float, float]:
        """(sum of squared errors, sum of squares) of this rank's quantized master shards
        against the masters: what the qwZ gather hands out, before compute-dtype rounding
        (summed over ranks and divided, the mean relative error of the gathered weights)."""
        error, norm = 0.0, 0.0
        if self.format is None:
            return error, norm
        for flat in flats:
            master = flat.master.detach()
            restored = dequantize(self._primary_payload(flat), self.format, flat.shard_numel)
            error += (restored - master).pow(2).sum().item()
            norm += master.pow(2).sum().item()
        if self.hierarchical:
            # A shard reaches the ranks of its own node exact and the (N - 1) D others
            # quantized: averaged over ranks, (N - 1) / N of the error reaches the compute.
            error *= (self.topology.num_nodes - 1) / self.topology.num_nodes
        return error, norm

    def _primary_payload(self, flat: FlatParam) -> torch.Tensor:
        if self.format is None:
            return flat.compute_shard()
        if flat.packed_shard is None:
            flat.packed_shard = self.quantize(flat.master.detach(), self.format)
        return flat.packed_shard

    def _secondary_part(self, gathered: torch.Tensor) -> torch.Tensor:
        """Member j of the hpZ group keeps part j of ``gathered`` split in hpz_size parts."""
        member = self.hpz.ranks.index(self.comm.comm_log.rank)
        part = gathered.numel() // self.hpz.size
        return gathered[member * part : (member + 1) * part].clone()
