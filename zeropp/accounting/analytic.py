"""Bytes one rank receives per training step, predicted from the layout and the config by
summing the strategies' own predictions (docs/design.md section 7).

One step is one forward, one backward and one optimizer step (no gradient accumulation):
every flat is gathered in forward; every flat but the root's (kept after forward unless
resharded) is gathered again in backward; every trainable flat is reduced once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig
from ..gather import select_weight_gather
from ..reduce import select_gradient_reduction
from ..topology import Layout
from ..traffic import Traffic

PHASES = ("forward_gather", "backward_gather", "reduce_scatter")


@dataclass(frozen=True)
class FlatSummary:
    is_root: bool
    requires_grad: bool
    shard_numel: int


def predicted_step_bytes(
    flats: list[FlatSummary], layout: Layout, config: ZeroConfig, rank: int, backend: str = "gloo"
) -> dict[str, dict[str, int]]:
    """``{phase: {"received_intra_node": bytes, "received_inter_node": bytes}}`` for ``rank``."""
    gather, reduction = select_weight_gather(config), select_gradient_reduction(config)
    totals = {phase: Traffic() for phase in PHASES}
    for flat in flats:
        shard, flat_gather = flat.shard_numel, gather.for_flat(flat.requires_grad)
        totals["forward_gather"] += flat_gather.predicted_bytes(shard, layout, rank, "forward_gather")
        if not flat.is_root or config.reshard_root_after_forward:
            totals["backward_gather"] += flat_gather.predicted_bytes(shard, layout, rank, "backward_gather")
        if flat.requires_grad:
            totals["reduce_scatter"] += reduction.predicted_bytes(shard, layout, rank, backend)
    return {phase: total.as_row() for phase, total in totals.items()}
