"""Bytes one rank receives per training step, predicted from the layout and the config by
summing the strategies' own predictions (docs/design.md section 7).

One step is one optimizer step over k micro-steps (k = 1 without gradient accumulation):
every flat is gathered in each forward; every flat but the root's (kept after forward
unless resharded) is gathered again in each backward; every trainable flat is reduced in
each micro-step, or inside the node and across nodes once with node accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig
from ..gather import select_weight_gather
from ..reduce import QgzReduction, select_gradient_reduction
from ..reduce.node_accumulation import predicted_bytes as node_accumulation_bytes
from ..topology import Layout
from ..traffic import Traffic

PHASES = ("forward_gather", "backward_gather", "reduce_scatter")


@dataclass(frozen=True)
class FlatSummary:
    is_root: bool
    requires_grad: bool
    shard_numel: int


def predicted_step_bytes(
    flats: list[FlatSummary], layout: Layout, config: ZeroConfig, rank: int, backend: str = "gloo",
    accumulation: int = 1, node_accumulation: bool = False,
) -> dict[str, dict[str, int]]:
    """``{phase: {"received_intra_node": bytes, "received_inter_node": bytes}}`` for ``rank``
    over one optimizer step of ``accumulation`` micro-steps. The first forward gathers from
    the primary shards; later ones find the weights unchanged and gather as backward does
    (from hpZ's or the delta gather's copy inside the node, else the same way again). With
    ``node_accumulation`` (``model.no_sync()`` for all but the last) gradients cross nodes
    once (``zeropp/reduce/node_accumulation.py``), else every micro-step reduces; with it and
    ``keep_weights_between_micro_steps`` the first forward's gathers are the step's only ones."""
    gather, reduction = select_weight_gather(config), select_gradient_reduction(config)
    gathers_once = node_accumulation and accumulation > 1 and config.keep_weights_between_micro_steps
    totals = {phase: Traffic() for phase in PHASES}
    quantized_hop = reduction if isinstance(reduction, QgzReduction) else None
    for flat in flats:
        shard, flat_gather = flat.shard_numel, gather.for_flat(flat.requires_grad)
        again = flat_gather.predicted_bytes(shard, layout, rank, "backward_gather")
        totals["forward_gather"] += flat_gather.predicted_bytes(shard, layout, rank, "forward_gather")
        for _ in range(0 if gathers_once else accumulation - 1):
            totals["forward_gather"] += again
        if not gathers_once and (not flat.is_root or config.reshard_root_after_forward):
            for _ in range(accumulation):
                totals["backward_gather"] += again
        if not flat.requires_grad:
            continue
        if node_accumulation and accumulation > 1:
            totals["reduce_scatter"] += node_accumulation_bytes(shard, layout, rank, accumulation,
                                                                config.reduce_torch_dtype, quantized_hop)
        else:
            for _ in range(accumulation):
                totals["reduce_scatter"] += reduction.predicted_bytes(shard, layout, rank, backend)
    return {phase: total.as_row() for phase, total in totals.items()}
