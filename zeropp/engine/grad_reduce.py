"""How a unit's gradient is reduce-scattered: plain (all-to-all + fp32 sum) or qgZ."""

from __future__ import annotations

import torch

from ..collectives import Communicator
from ..collectives.quantized_reduce_scatter import HierarchicalReduceScatter
from ..config import ZeroConfig
from ..quantization import quantizer
from ..topology import Topology


class GradientReducer:
    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config = config
        self.topology = topology
        self.comm = communicator
        self.world = topology.group("world")

    def start(self, flat_grad: torch.Tensor, label: str = ""):
        """``flat_grad`` [W * S] -> a pending object whose ``wait()`` gives the mean shard
        [S] fp32 and whose ``progress()`` launches what can be launched."""
        if self.config.quantized_gradients:
            return HierarchicalReduceScatter(
                flat_grad,
                self.topology,
                self.comm,
                self.config.gradient_formats,
                self.config.gradient_chunks,
                quantizer(self.config.compile_quantization),
                label,
            )
        to_send = flat_grad.to(self.config.reduce_torch_dtype)
        return self.comm.reduce_scatter_mean(to_send, self.world, "reduce_scatter", label)
