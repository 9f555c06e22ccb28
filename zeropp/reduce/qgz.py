"""qgZ: reduce-scatter as a two-hop all-to-all on quantized blocks (docs/design.md
section 5.2).

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

Options (all in the config): bits per hop and the inter-node grid, a Hadamard rotation,
error feedback on the inter-node hop, stochastic rounding.
"""

from __future__ import annotations

import numpy
import torch

from .. import traffic
from ..quantization import BlockFormat, dequantizer, quantize, quantizer
from ..quantization.hadamard import hadamard
from ..topology import Layout
from ..traffic import Traffic
from .base import GradientReduction

PHASE = "reduce_scatter"


def rounding_seed(rank: int, reduction: int) -> int:
    """A 32-bit seed for stochastic rounding, distinct per (rank, reduction): the CPU
    generator keeps only the low 32 bits of a seed, so (rank << 40) + reduction gave every
    rank the same noise and their rounding errors added up instead of averaging out."""
    return int(numpy.random.SeedSequence([rank, reduction]).generate_state(1)[0])


class QgzReduction(GradientReduction):
    """Starts qgZ buckets; owns the error-feedback residuals, one list per unit."""

    def __init__(self, config, topology=None, communicator=None) -> None:
        super().__init__(config, topology, communicator)
        self.intra_format, self.inter_format = config.gradient_formats
        self.num_chunks = config.gradient_chunks
        self.hadamard_size = config.gradient_hadamard
        self._fast_quantize = quantizer(config.compile_quantization)
        self._fast_dequantize = dequantizer(config.compile_quantization)
        self.residuals: dict[str, list] = {}  # unit label -> one residual [N, s] per chunk
        self.reductions_started = 0
        # The inter-node hops start when their intra-node hop has arrived, which differs
        # between ranks: a side group keeps them apart from the gathers on "inter_node" (the
        # two-hop gather's, in backward without hpZ), whose order is the program's.
        self.inter_group = None
        if topology is not None and topology.num_nodes > 1:
            self.inter_group = topology.side_group("inter_node", "qgz")

    def start(self, flat_grad, label: str = "") -> "QgzBucket":
        residuals = None
        if self.config.gradient_error_feedback:
            residuals = self.residuals.setdefault(label, [None] * self.num_chunks)
        return QgzBucket(self, flat_grad, label, residuals, self._rounding_noise(flat_grad))

    def carry_state_from(self, previous) -> None:
        if isinstance(previous, QgzReduction):
            self.residuals = previous.residuals
            self.reductions_started = previous.reductions_started

    def _rounding_noise(self, flat_grad: torch.Tensor) -> torch.Generator | None:
        """A generator of its own per reduction, seeded by rank and by how many reductions
        this rank started before (an order backward fixes), so a run can be repeated; on the
        gradients' device, as a CPU generator cannot draw CUDA noise."""
        if not self.config.gradient_stochastic_rounding:
            return None
        self.reductions_started += 1
        generator = torch.Generator(device=flat_grad.device)
        return generator.manual_seed(rounding_seed(self.topology.rank, self.reductions_started))

    # The wire format of one hop; a variant of qgZ may override these three together.
    def quantize(self, rows: torch.Tensor, fmt: BlockFormat, generator=None) -> torch.Tensor:
        """[K, n] values -> [K, packed_nbytes(n)] uint8."""
        if generator is not None:
            return quantize(rows, fmt, generator)
        return self._fast_quantize(rows, fmt)

    def dequantize(self, packed: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
        """[K, packed_nbytes(numel)] uint8 -> [K, numel] fp32."""
        return self._fast_dequantize(packed, fmt, numel)

    def packed_nbytes(self, fmt: BlockFormat, numel: int) -> int:
        return fmt.packed_nbytes(numel)

    def held_bytes(self, shard_numel: int, layout: Layout, backend: str = "gloo") -> int:
        """Packed codes only, per chunk of s values sent and received on each hop: the
        gradient itself is released once its rows are quantized, at the start."""
        nodes, per_node = layout.num_nodes, layout.ranks_per_node
        chunk = shard_numel // self.num_chunks
        intra = 2 * per_node * self.packed_nbytes(self.intra_format, nodes * chunk)
        inter = 2 * nodes * self.packed_nbytes(self.inter_format, chunk)
        return self.num_chunks * (intra + inter)

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, backend: str = "gloo") -> Traffic:
        nodes = layout.num_nodes
        intra = traffic.exchange(layout, rank, traffic.intra_node(layout, rank),
                                 self.packed_nbytes(self.intra_format, nodes * shard_numel))
        inter = traffic.exchange(layout, rank, traffic.inter_node(layout, rank),
                                 self.packed_nbytes(self.inter_format, shard_numel))
        return intra + inter

    def collective_steps(self, layout: Layout) -> int:
        return layout.ranks_per_node - 1 + layout.num_nodes - 1


class QgzBucket:
    """One reduction in flight. ``progress`` launches the inter-node hop of every chunk
    whose intra-node hop has arrived; ``wait`` finishes everything and returns [S] fp32.

    ``residuals`` (one slot per chunk, kept by the strategy between steps) turns on error
    feedback for the inter-node hop: what quantization dropped from this rank's node
    partial sums [N, s] is added back before quantizing them next time.

    A ``generator`` turns on stochastic rounding. Each reduction has its own: buckets in
    flight together quantize in an order that depends on timing, so one generator shared
    between them would make a run impossible to repeat.
    """

    def __init__(self, strategy: QgzReduction, flat_grad: torch.Tensor, label: str,
                 residuals: list | None, generator: torch.Generator | None) -> None:
        topology = strategy.topology
        self.nodes, self.per_node = topology.num_nodes, topology.ranks_per_node
        self.world_size = topology.world_size
        self.intra = topology.group("intra_node")
        self.inter = strategy.inter_group
        self.strategy = strategy
        self.comm = strategy.comm
        self.label = label
        self.residuals = residuals
        self.generator = generator
        num_chunks = strategy.num_chunks
        shard = flat_grad.numel() // self.world_size
        assert shard % num_chunks == 0
        self.chunk = shard // num_chunks  # s
        # [N, D, C, s] -> [C, D, N, s]: chunk c, destination local rank d, node n.
        swizzled = flat_grad.view(self.nodes, self.per_node, num_chunks, self.chunk).permute(2, 1, 0, 3)
        self._intra = [self._start_intra(swizzled[c].reshape(self.per_node, -1)) for c in range(num_chunks)]
        self._inter: list = [None] * num_chunks

    def _start_intra(self, rows: torch.Tensor):
        """rows [D, N * s]: row d goes to local rank d."""
        if self.strategy.hadamard_size:
            rows = hadamard(rows, self.strategy.hadamard_size)
        if self.per_node == 1:
            return None, rows.float()
        packed = self.strategy.quantize(rows, self.strategy.intra_format, self.generator)
        received = torch.empty_like(packed)
        return self.comm.all_to_all(received, packed, self.intra, PHASE, self.label), received

    def _start_inter(self, index: int) -> None:
        work, received = self._intra[index]
        if work is not None:
            work.wait()
        self._intra[index] = (None, None)  # its rows are summed below: the buffer can go
        if self.per_node > 1:
            received = self.strategy.dequantize(received, self.strategy.intra_format, self.nodes * self.chunk)
        partial = received.sum(dim=0).view(self.nodes, self.chunk)  # [N, s] fp32
        if self.nodes == 1:
            self._inter[index] = (None, partial)
            return
        if self.residuals is not None and self.residuals[index] is not None:
            partial = partial + self.residuals[index]
        packed = self.strategy.quantize(partial, self.strategy.inter_format, self.generator)
        if self.residuals is not None:
            self.residuals[index] = partial - self.strategy.dequantize(packed, self.strategy.inter_format, self.chunk)
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

    def release(self) -> bool:
        """Wait for the intra-node hops and launch every inter-node hop: what stays in flight
        holds only the node's quantized partial sums, [N, packed s] per chunk, and the link
        carries them under the next units' backward (else, with one reduction in flight,
        each inter-node hop would start and be waited for at the next unit's gradient).
        False on one node: there is no inter-node hop to leave in flight."""
        if self.nodes == 1:
            return False
        for index in range(len(self._intra)):
            if self._inter[index] is None:
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
                incoming = self.strategy.dequantize(incoming, self.strategy.inter_format, self.chunk)
            piece = incoming.sum(dim=0)
            if self.strategy.hadamard_size:  # the transform is its own inverse
                piece = hadamard(piece, self.strategy.hadamard_size)
            pieces.append(piece)
        return torch.cat(pieces).div_(self.world_size)
