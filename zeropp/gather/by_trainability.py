"""MixZ++: one gather for trainable flats, another for frozen ones (docs/design.md
section 4.5). Frozen weights never change, so their block-quantized shards are packed once
and, with hpZ, the packed secondary copy inside the node is never dropped: after the first
gather, frozen weights (RLHF's reference and reward models, a LoRA base) stay in the node.
"""

from __future__ import annotations

from ..topology import Layout
from ..traffic import Traffic
from .base import WeightGather
from .secondary import SecondaryGather


class ByTrainability(WeightGather):
    def __init__(self, trainable: WeightGather, frozen: WeightGather) -> None:
        super().__init__(trainable.config, trainable.topology, trainable.comm)
        self.trainable = trainable
        self.frozen = frozen

    def for_flat(self, requires_grad: bool) -> WeightGather:
        return self.trainable if requires_grad else self.frozen

    def start(self, flat, phase: str):
        return self.for_flat(flat.requires_grad).start(flat, phase)

    def finish(self, flat, pending):
        return self.for_flat(flat.requires_grad).finish(flat, pending)

    def invalidate(self, flat) -> None:
        self.for_flat(flat.requires_grad).invalidate(flat)

    def forget(self, flat) -> None:
        self.for_flat(flat.requires_grad).forget(flat)

    def saved_state(self, flat):
        return self.for_flat(flat.requires_grad).saved_state(flat)

    def load_saved_state(self, flat, state) -> None:
        self.for_flat(flat.requires_grad).load_saved_state(flat, state)

    def kept_tensors(self) -> list:
        return self.trainable.kept_tensors() + self.frozen.kept_tensors()

    def holds_copy(self, flat) -> bool:
        return self.for_flat(flat.requires_grad).holds_copy(flat)

    def quantization_error_sums(self, flats) -> tuple[float, float]:
        sums = [gather.quantization_error_sums([f for f in flats if f.requires_grad == trainable])
                for trainable, gather in ((True, self.trainable), (False, self.frozen))]
        return sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        raise AssertionError("ask for_flat(requires_grad) for the gather of one flat")

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return self.trainable.collective_steps(layout, phase)


class ResidentSecondary(SecondaryGather):
    """hpZ for weights that never change: in steady state every gather, forward included,
    comes from the parts inside the node (the first one ever crosses nodes)."""

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        return super().predicted_bytes(shard_numel, layout, rank, "backward_gather")

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return super().collective_steps(layout, "backward_gather")
