"""Dynamic loss scaling for fp16 compute: fp16 gradients of a loss of order 1 underflow to
zero, so the loss is multiplied by a large scale before backward and the fp32 master
gradients are divided by it before the step. A step whose gradients overflowed is skipped
and the scale halved; after ``growth_interval`` good steps it doubles (as in
``torch.amp.GradScaler``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicLossScale:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    minimum: float = 1.0
    good_steps: int = 0

    def update(self, overflowed: bool) -> None:
        """After a step: back off on overflow, grow after enough good steps in a row."""
        if overflowed:
            self.scale = max(self.minimum, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
