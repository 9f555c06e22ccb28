"""The delta gather: across nodes only each shard's change since the copy the other nodes
hold, block-quantized (docs/design.md section 4.6). Two collectives per gather; with
rank ``r = n * D + d`` and shard ``S`` values::

    across  among the ranks with local index d: the packed change of shard (n', d) of
            every node n', only after the masters changed
    within  inside the node, compute dtype: every local rank's row of N shards (its own
            exact, the other nodes' from its copies), one all-gather of [D, N, S]

Rank (n, d) keeps ``reference`` [N, S] fp32: row n' is shard (n', d) as every rank with
local index d has rebuilt it, its own row included. Each sends ``Q(master - own row)`` and
every receiver adds the same dequantized bytes to the same row, so the copies stay
bit-identical without ever being compared, and what rounding dropped this step is part of
the next change (error feedback for free): the copy trails the master by at most half a
quantization step of the last change. Backward repeats the within-node gather from the
unchanged copies, so it never crosses nodes: the copies are hpZ's secondary as well. One
within-node collective carries this node's shards and the copies together (the same bytes
as two), which saves a collective per gather on fast links.

The first gather of a flat, and the first after its masters were loaded, sends the masters
exactly (fp32, phase ``weight_refresh``), which starts every copy from the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import traffic
from ..quantization import dequantizer, quantizer
from ..topology import Layout
from ..traffic import Traffic
from .base import WeightGather

REFRESH_PHASE = "weight_refresh"


@dataclass
class _Pending:
    within_node: object | None  # the within-node gather's work (None until the copies are current, or on one rank per node)
    gathered: torch.Tensor | None  # [D, N, S] what it brings, compute dtype (None on one node)
    across_nodes: object | None  # the across-node gather's work, None when the copies are current
    from_nodes: torch.Tensor | None  # [N, P] packed changes, or [N, S] fp32 masters when refreshing
    refresh: bool
    phase: str


class DeltaGather(WeightGather):
    def __init__(self, config, topology=None, communicator=None) -> None:
        super().__init__(config, topology, communicator)
        self.format = config.weight_delta_format
        self.quantize = quantizer(config.compile_quantization)
        self.dequantize = dequantizer(config.compile_quantization)
        self.references: dict[str, torch.Tensor] = {}  # flat name -> fp32 [N, S], kept across steps
        self._current: set[str] = set()  # flats whose copies match their masters' last version

    def start(self, flat, phase: str) -> _Pending:
        if flat.name in self._current or self.topology.num_nodes == 1:
            return self._start_within_node(flat, _Pending(None, None, None, None, False, phase))
        nodes = self.topology.num_nodes
        refresh = flat.name not in self.references
        if refresh:
            payload, phase_across = flat.master.detach(), REFRESH_PHASE
        else:
            payload, phase_across = self.quantize(flat.master.detach() - self._own_row(flat), self.format), phase
        from_nodes = payload.new_empty(nodes, payload.numel())  # [N, P] or [N, S]
        across = self.comm.all_gather(from_nodes.view(-1), payload, self.topology.group("inter_node"), phase_across,
                                      flat.name)
        return _Pending(None, None, across, from_nodes, refresh, phase)

    def finish(self, flat, pending: _Pending) -> torch.Tensor:
        if pending.from_nodes is not None:  # the changes first: the copies must be current
            self._wait(pending.across_nodes)
            self._update_references(flat, pending)
            self._start_within_node(flat, pending)
        self._wait(pending.within_node)
        if pending.gathered is not None:
            nodes, per_node = self.topology.num_nodes, self.topology.ranks_per_node
            flat.full_data.view(nodes, per_node, flat.shard_numel).copy_(pending.gathered.transpose(0, 1))
        return flat.full_data

    def _start_within_node(self, flat, pending: _Pending) -> _Pending:
        """Every local rank sends its row [N, S]: its own shard exact, the other nodes'
        from its copies; row d of the result is shard (n', d) for every node n'."""
        nodes, per_node, node = self.topology.num_nodes, self.topology.ranks_per_node, self.topology.node
        group = self.topology.group("intra_node")
        if nodes == 1:  # no copies: a plain gather of the node's shards, straight into the buffer
            pending.within_node = self.comm.all_gather(flat.full_data, flat.compute_shard(), group, pending.phase,
                                                       flat.name)
            return pending
        row = self.references[flat.name].to(flat.full_data.dtype, copy=True)  # [N, S]; the copies stay as sent
        row[node] = flat.compute_shard()
        pending.gathered = row.new_empty(per_node, nodes, flat.shard_numel)
        pending.within_node = self.comm.all_gather(pending.gathered.view(-1), row.view(-1), group, pending.phase,
                                                   flat.name)
        return pending

    def _own_row(self, flat) -> torch.Tensor:
        return self.references[flat.name][self.topology.node]

    def _update_references(self, flat, pending: _Pending) -> None:
        if pending.refresh:
            self.references[flat.name] = pending.from_nodes.clone()
        else:
            self.references[flat.name] += self.dequantize(pending.from_nodes, self.format, flat.shard_numel)
        self._current.add(flat.name)

    def invalidate(self, flat) -> None:
        self._current.discard(flat.name)

    def forget(self, flat) -> None:
        self._current.discard(flat.name)
        self.references.pop(flat.name, None)

    def saved_state(self, flat) -> torch.Tensor | None:
        return self.references.get(flat.name)

    def load_saved_state(self, flat, state: torch.Tensor) -> None:
        """The copies as saved: the next gather sends the change since them, as the run
        that saved would have."""
        self.references[flat.name] = state.to(flat.master.device, torch.float32).clone()
        self._current.discard(flat.name)

    def holds_copy(self, flat) -> bool:
        return flat.name in self._current

    def kept_bytes(self, shard_numel: int, layout: Layout) -> int:
        return layout.num_nodes * shard_numel * 4  # the fp32 copy of this rank's shard row of every node

    def receive_bytes(self, shard_numel: int, layout: Layout) -> int:
        """The row sent inside the node [N, S] and what arrives [D, N, S], compute dtype."""
        return (layout.num_nodes + layout.world_size) * shard_numel * self.compute_itemsize

    def kept_tensors(self) -> list[torch.Tensor]:
        return list(self.references.values())

    def quantization_error_sums(self, flats) -> tuple[float, float]:
        """Error of this rank's shard as the other nodes hold it after the next gather
        (computed aside, nothing sent or kept); 0 before the first (exact) refresh. Called
        between an optimizer step and the next forward, when the engine has not yet told
        the gather that the masters moved: a trainable flat is taken to send its change,
        a frozen one to keep its copy."""
        error, norm = 0.0, 0.0
        for flat in flats:
            master = flat.master.detach()
            norm += master.pow(2).sum().item()
            if flat.name not in self.references:
                continue
            restored = self._own_row(flat)
            if flat.requires_grad or flat.name not in self._current:
                change = self.dequantize(self.quantize(master - restored, self.format), self.format, flat.shard_numel)
                restored = restored + change
            error += (restored - master).pow(2).sum().item()
        # As in the two-hop gather, (N - 1) / N of the ranks see a shard through a copy.
        nodes = self.topology.num_nodes
        return error * (nodes - 1) / nodes, norm

    def chunk_bytes(self, shard_numel: int) -> int:
        return shard_numel * self.compute_itemsize

    def _across_chunk_bytes(self, shard_numel: int, phase: str) -> int:
        if phase == REFRESH_PHASE:
            return shard_numel * 4
        return self.format.packed_nbytes(shard_numel)

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        """Forward after an optimizer step: the packed changes across nodes, then the
        within-node gather of N shards per rank; backward right after: the within-node gather
        alone; ``weight_refresh``: the fp32 masters across nodes."""
        node_group, inter_group = traffic.intra_node(layout, rank), traffic.inter_node(layout, rank)
        across = traffic.ring(layout, rank, inter_group, self._across_chunk_bytes(shard_numel, phase))
        if phase == REFRESH_PHASE:
            return across
        within = traffic.ring(layout, rank, node_group, layout.num_nodes * shard_numel * self.compute_itemsize)
        return within + (across if phase == "forward_gather" else Traffic())

    def collective_steps(self, layout: Layout, phase: str) -> int:
        across = layout.num_nodes - 1 if phase != "backward_gather" else 0
        return layout.ranks_per_node - 1 + across

    def for_flat(self, requires_grad: bool) -> WeightGather:
        return self if requires_grad else _FrozenPrediction(self)


class _FrozenPrediction(WeightGather):
    """The accounting's view of frozen flats under the delta gather: their masters never
    change, so after the first gather every gather is the backward one (within the node)."""

    def __init__(self, gather: DeltaGather) -> None:
        super().__init__(gather.config)
        self.gather = gather

    def chunk_bytes(self, shard_numel: int) -> int:
        return self.gather.chunk_bytes(shard_numel)

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        return self.gather.predicted_bytes(shard_numel, layout, rank, "backward_gather")

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return self.gather.collective_steps(layout, "backward_gather")
