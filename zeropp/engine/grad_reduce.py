"""How a unit's gradient is reduce-scattered: plain (all-to-all + fp32 sum) or qgZ."""

from __future__ import annotations

import torch

from ..collectives import Communicator
from ..collectives.quantized_reduce_scatter import HierarchicalReduceScatter, QgzOptions
from ..config import ZeroConfig
from ..quantization import quantizer
from ..topology import Topology


class GradientReducer:
    """Starts reductions; owns the qgZ error-feedback residuals, one list per unit."""

    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config = config
        self.topology = topology
        self.comm = communicator
        self.world = topology.group("world")
        self.options = QgzOptions(
            formats=config.gradient_formats,
            num_chunks=config.gradient_chunks,
            quantizer=quantizer(config.compile_quantization),
            hadamard_size=config.gradient_hadamard,
        )
        self.residuals: dict[str, list] = {}
        self.reductions_started = 0

    def _rounding_noise(self, flat_grad: torch.Tensor) -> torch.Generator | None:
        """A generator of its own per reduction, seeded by rank and by how many reductions
        this rank started before (an order backward fixes), so a run can be repeated; on the
        gradients' device, as a CPU generator cannot draw CUDA noise."""
        if not self.config.gradient_stochastic_rounding:
            return None
        self.reductions_started += 1
        generator = torch.Generator(device=flat_grad.device)
        return generator.manual_seed((self.topology.rank << 40) + self.reductions_started)

    def use_formats(self, config: ZeroConfig) -> None:
        """Quantize in ``config``'s gradient formats from the next reduction on."""
        self.config = config
        self.options.formats = config.gradient_formats

    def start(self, flat_grad: torch.Tensor, label: str = ""):
        """``flat_grad`` [W * S] -> a pending object whose ``wait()`` gives the mean shard
        [S] fp32 and whose ``progress()`` launches what can be launched."""
        if self.config.quantized_gradients:
            residuals = None
            if self.config.gradient_error_feedback:
                residuals = self.residuals.setdefault(label, [None] * self.config.gradient_chunks)
            return HierarchicalReduceScatter(
                flat_grad, self.topology, self.comm, self.options, label, residuals, self._rounding_noise(flat_grad)
            )
        to_send = flat_grad.to(self.config.reduce_torch_dtype)
        return self.comm.reduce_scatter_mean(to_send, self.world, "reduce_scatter", label)
