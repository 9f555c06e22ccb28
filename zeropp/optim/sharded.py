"""Any ``torch.optim`` optimizer, stepping on the rank's fp32 master shards only.

Because each rank owns a disjoint slice of every flat buffer, the optimizer's state is
1/W of the replicated optimizer's, and an element-wise optimizer (SGD, Adam, AdamW, ...)
produces exactly the values the replicated one would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..accounting import CollectiveRecord
from ..engine import ShardedModel


class ShardedOptimizer:
    """``optimizer_factory`` receives the master shards and returns a torch optimizer."""

    def __init__(
        self,
        model: ShardedModel,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.model = model
        self.optimizer = optimizer_factory(model.master_parameters())

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for param in self.model.master_parameters():
            param.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm
        before clipping. Padding contributes zeros; tied weights are counted once."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        grads = [p.grad for p in self.model.master_parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float64)
        for grad in grads:
            local += grad.double().pow(2).sum().cpu()
        total = local.to(self.model.master_parameters()[0].device)
        self._record_norm_all_reduce(total)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.model.topology.group("world").handle)
        norm = total.sqrt().float()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
        return norm

    def step(self) -> None:
        self.optimizer.step()
        self.model.on_weights_changed()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def _record_norm_all_reduce(self, total: torch.Tensor) -> None:
        # An 8-byte all-reduce per step; recorded so the step's accounting is complete.
        world = self.model.topology.group("world")
        self.model.comm_log.record_exchange("all_reduce", world.ranks, "grad_norm", total.element_size())
