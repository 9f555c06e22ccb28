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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..quantization import BlockFormat, dequantize, quantize
from ..quantization.hadamard import hadamard
from ..topology import Topology
from .primitives import Communicator

PHASE = "reduce_scatter"


@dataclass
class QgzOptions:
    formats: tuple[BlockFormat, BlockFormat]  # (intra-node hop, inter-node hop)
    num_chunks: int = 2
    quantizer: Callable = quantize  # eager or compiled: the same codes
    hadamard_size: int = 0  # rotate groups of this many values first; 0: off


class HierarchicalReduceScatter:
    """One bucket in flight. ``progress`` launches the inter-node hop of every chunk whose
    intra-node hop has arrived; ``wait`` finishes everything and returns [S] fp32.

    ``residuals`` (one slot per chunk, kept by the caller between steps) turns on error
    feedback for the inter-node hop: what quantization dropped from this rank's node
    partial sums [N, s] is added back before quantizing them next time.

    A ``generator`` turns on stochastic rounding. Give each reduction its own: buckets in
    flight together quantize in an order that depends on timing, so one generator shared
    between them would make a run impossible to repeat.
    """

    def __init__(
        self,
        flat_grad: torch.Tensor,
        topology: Topology,
        communicator: Communicator,
        options: QgzOptions,
        label: str = "",
        residuals: list | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.nodes, self.per_node = topology.num_nodes, topology.ranks_per_node
        self.world_size = topology.world_size
        self.intra = topology.group("intra_node")
        self.inter = topology.group("inter_node")
        self.comm = communicator
        self.options = options
        self.intra_format, self.inter_format = options.formats
        self.label = label
        self.residuals = residuals
        self.generator = generator
        shard = flat_grad.numel() // self.world_size
        assert shard % options.num_chunks == 0
        self.chunk = shard // options.num_chunks  # s
        # [N, D, C, s] -> [C, D, N, s]: chunk c, destination local rank d, node n.
        swizzled = flat_grad.view(self.nodes, self.per_node, options.num_chunks, self.chunk).permute(2, 1, 0, 3)
        self._intra = [self._start_intra(swizzled[c].reshape(self.per_node, -1)) for c in range(options.num_chunks)]
        self._inter: list = [None] * options.num_chunks

    def _quantize(self, rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
        if self.generator is not None:
            return quantize(rows, fmt, self.generator)
        return self.options.quantizer(rows, fmt)

    def _start_intra(self, rows: torch.Tensor):
        """rows [D, N * s]: row d goes to local rank d."""
        if self.options.hadamard_size:
            rows = hadamard(rows, self.options.hadamard_size)
        if self.per_node == 1:
            return None, rows.float()
        packed = self._quantize(rows, self.intra_format)
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
        if self.residuals is not None and self.residuals[index] is not None:
            partial = partial + self.residuals[index]
        packed = self._quantize(partial, self.inter_format)
        if self.residuals is not None:
            self.residuals[index] = partial - dequantize(packed, self.inter_format, self.chunk)
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
            piece = incoming.sum(dim=0)
            if self.options.hadamard_size:  # the transform is its own inverse
                piece = hadamard(piece, self.options.hadamard_size)
            pieces.append(piece)
        return torch.cat(pieces).div_(self.world_size)
