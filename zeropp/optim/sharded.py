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

from ..engine import ShardedModel
from .loss_scale import DynamicLossScale


NONFINITE_POLICIES = ("skip", "raise")


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_factory`` receives the master shards and returns a torch optimizer.

    A ``torch.optim.Optimizer`` itself, sharing the inner optimizer's ``param_groups`` and
    ``state``, so ``torch.optim.lr_scheduler`` schedulers drive it as they drive any
    optimizer. What it adds: a step that every rank skips together on NaN or inf gradients,
    and gradient clipping by the global norm of the sharded gradients."""

    def __init__(
        self,
        model: ShardedModel,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        on_nonfinite: str = "skip",
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r}; allowed values: {list(NONFINITE_POLICIES)}")
        # fp16 gradients underflow without a loss scale; bf16 and fp32 need none.
        self.loss_scale = DynamicLossScale() if model.config.compute_torch_dtype == torch.float16 else None
        self._scaled_since_step = False
        self._unscaled = False
        inner = optimizer_factory(model.master_parameters())
        super().__init__(model.master_parameters(), inner.defaults)  # sets up the hooks schedulers use
        self.optimizer = inner
        # One set of groups and one state: a scheduler's learning rate reaches the inner step.
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (fp16 compute), else ``loss`` itself: call
        ``optimizer.scale_loss(loss).backward()``."""
        if self.loss_scale is None:
            return loss
        self._scaled_since_step = True
        return loss * self.loss_scale.scale

    @torch.no_grad()
    def _unscale(self) -> None:
        """Divide the master gradients by the loss scale, once per step."""
        if self.loss_scale is None or self._unscaled:
            return
        if not self._scaled_since_step:
            raise ValueError("compute_dtype='fp16' trains with dynamic loss scaling: call "
                             "optimizer.scale_loss(loss).backward() instead of loss.backward()")
        for param in self.model.master_parameters():
            if param.grad is not None:
                param.grad.mul_(1.0 / self.loss_scale.scale)
        self._unscaled = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm
        before clipping. Padding contributes zeros; tied weights are counted once."""
        self._unscale()
        return self.model.clip_grad_norm_(max_norm)

    def step(self, closure=None) -> bool:
        """Step unless some rank has a NaN or inf gradient: then skip (count it in
        ``skipped_steps``) or raise, per ``on_nonfinite``. Returns whether it stepped. With
        fp16 compute an overflow is part of loss scaling: the step is skipped and the scale
        halved, never raised."""
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure: run forward and backward before calling it")
        self._unscale()
        sources = self._nonfinite_sources()
        self._scaled_since_step = self._unscaled = False
        if self.loss_scale is not None:
            self.loss_scale.update(overflowed=bool(sources))
        if sources:
            self.skipped_steps += 1
            if self.on_nonfinite == "raise" and self.loss_scale is None:
                raise FloatingPointError(f"non-finite gradients, by rank and unit: {sources}; the step was not applied")
            self.zero_grad()
            return False
        self.optimizer.step()  # the model notices (a step hook) and refreshes before its next forward
        return True

    def _nonfinite_sources(self) -> dict[int, list[str]]:
        """{rank: units} of every rank whose local gradients had NaN or inf this step
        ({-1: [...]} when only the reduction overflowed)."""
        topology = self.model.topology
        local = self.model.take_nonfinite_units()
        # flags[r]: rank r's own gradients were non-finite; flags[-1]: some reduced shard is
        # (finite inputs can still overflow when summed in a narrow reduce dtype).
        flags = torch.zeros(topology.world_size + 1, dtype=torch.float32, device=topology.device)
        flags[topology.rank] = float(bool(local))
        sums = [p.grad.sum(dtype=torch.float32) for p in self.model.master_parameters() if p.grad is not None]
        flags[-1] = float(bool(sums) and not torch.isfinite(torch.stack(sums)).all())
        self.model.communicator.all_reduce_sum(flags, topology.group("world"), "grad_check")
        if not flags[:-1].any():
            return {-1: ["<overflow in the gradient reduction>"]} if flags[-1] > 0 else {}
        everyone = [None] * topology.world_size  # the rare path: gather the unit names
        dist.all_gather_object(everyone, local, group=topology.group("world").handle)
        return {rank: units for rank, units in enumerate(everyone) if units}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
