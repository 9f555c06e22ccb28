"""qgZ: reduce-scatter as a two-hop all-to-all on quantized blocks (DESIGN.md section 5).

Input: the flat gradient [W * S], partition ``p = n * D + d`` (S values) belonging to rank p.
Output on every rank: the mean over all W ranks of its own partition, fp32 [S] — the same
layout a plain reduce-scatter gives.

Each partition is cut into C chunks of ``s = S / C`` values; chunk c of every partition
travels together, so the intra-node hop of chunk c + 1 overlaps the inter-node hop of c::

    swizzle   x[n, d, c] -> y[c, d, n]         row d of y[c] goes to local rank d
    hop 1     quantize rows, all-to-all inside the node (skipped when D == 1)
              dequantize, sum the D rows in fp32: [N, s], row m is node m's partial sum
              of partition m * D + d
    hop 2     quantize rows, all-to-all across nodes (skipped when N == 1)
              dequantize, sum the N rows in fp32, divide by W
"""

from __future__ import annotations

import torch

from ..quantization import BlockFormat, dequantize, quantize
from ..topology import Topology
from .primitives import Communicator

PHASE = "reduce_scatter"


class HierarchicalReduceScatter:
    """One bucket in flight. ``progress`` launches the inter-node hop of every chunk whose
    intra-node hop has arrived; ``wait`` finishes everything and returns [S] fp32."""

    def __init__(
        self,
        flat_grad: torch.Tensor,
        topology: Topology,
        communicator: Communicator,
        formats: tuple[BlockFormat, BlockFormat],
        num_chunks: int,
        quantizer=quantize,
        label: str = "",
    ) -> None:
        self.label = label
        self.quantize = quantizer  # eager or compiled: the same codes
        self.nodes, self.per_node = topology.num_nodes, topology.ranks_per_node
        self.world_size = topology.world_size
        self.intra = topology.group("intra_node")
        self.inter = topology.group("inter_node")
        self.comm = communicator
        self.intra_format, self.inter_format = formats
        shard = flat_grad.numel() // self.world_size
        assert shard % num_chunks == 0
        self.chunk = shard // num_chunks  # s
        # [N, D, C, s] -> [C, D, N, s]: chunk c, destination local rank d, node n.
        swizzled = flat_grad.view(self.nodes, self.per_node, num_chunks, self.chunk).permute(2, 1, 0, 3)
        self._intra = [self._start_intra(swizzled[c].reshape(self.per_node, -1)) for c in range(num_chunks)]
        self._inter: list = [None] * num_chunks

    def _start_intra(self, rows: torch.Tensor):
        """rows [D, N * s]: row d goes to local rank d."""
        if self.per_node == 1:
            return None, rows.float()
        packed = self.quantize(rows, self.intra_format)
        received = torch.empty_like(packed)
        return self.comm.all_to_all(received, packed, self.intra, PHASE, self.label), received

    def _start_inter(self, index: int) -> None:
        work, received = self._intra[index]
        if work is not None:
            work.wait()
        if self.per_node > 1:
            received = dequantize(received, self.intra_format, self.nodes * self.chunk)
        partial = received.sum(dim=0).view(self.nodes, self.chunk)  # [N, s] fp32
        if self.nodes == 1:
            self._inter[index] = (None, partial)
            return
        packed = self.quantize(partial, self.inter_format)
        incoming = torch.empty_like(packed)
        self._inter[index] = (self.comm.all_to_all(incoming, packed, self.inter, PHASE, self.label), incoming)

    def progress(self) -> bool:
        """Launch inter-node hops strictly in chunk order (every member of the inter-node
        group must issue them in the same order); True once all are launched."""
        for index, (work, _) in enumerate(self._intra):
            if self._inter[index] is not None:
                continue
            if work is not None and not work.is_completed():
                return False
            self._start_inter(index)
        return True

    def wait(self) -> torch.Tensor:
        pieces = []
        for index in range(len(self._intra)):
            if self._inter[index] is None:
                self._start_inter(index)
        for work, incoming in self._inter:
            if work is not None:
                work.wait()
            if self.nodes > 1:
                incoming = dequantize(incoming, self.inter_format, self.chunk)
            pieces.append(incoming.sum(dim=0))
        return torch.cat(pieces).div_(self.world_size)
