"""The named communication schemes the benchmarks and the convergence study run, as
``ZeroConfig`` overrides: one home, so that ``zeropp bench throughput --variants
log-grid`` runs the setting the study measured the loss of.

Auto mode's seven candidates come from the tuner (:func:`zeropp.auto.candidate_schemes`);
the others are the study's lower-loss settings and the variants that attribute their cost.
"""

from __future__ import annotations

from zeropp.auto import candidate_schemes

# INT8 gradients inside the node, 4 bits on a grid of powers of two across nodes.
LOG_GRID_GRADIENTS = {"gradient_bits_intra_node": 8, "gradient_grid_inter_node": "log"}
WEIGHT_DELTAS = {"weight_deltas": True, "weight_delta_bits": 3, "quantized_gradients": True}
QUALITY_SETTINGS = ("log-grid", "zero++-log-grid")
"""The convergence study's lower-loss settings at ZeRO++'s bytes across nodes: the
throughput benchmark reports each one's tokens/s against zero++'s."""


def named_schemes(ranks_per_node: int) -> dict[str, dict[str, object]]:
    """Every named scheme on a layout of ``ranks_per_node`` ranks per node (hpZ spans the node)."""
    candidates = candidate_schemes(ranks_per_node)
    zero_pp = candidates["zero++"]
    return {
        **candidates,
        "auto": {"auto": True},
        # The convergence study's best-quality setting at ZeRO++'s bytes: two-hop INT12
        # weights, INT8 / log-grid INT4 gradients.
        "log-grid": {**candidates["zero++-two-hop"], "weight_bits": 12, **LOG_GRID_GRADIENTS},
        # The same numerics through the ring (INT12 for every shard, also this node's): 1.5x
        # zero++'s bytes across nodes, none of the two-hop shape's exact intra-node hop.
        "log-grid-ring": {**zero_pp, "weight_bits": 12, **LOG_GRID_GRADIENTS},
        # Issue 17's setting: INT3 weight changes through the two-hop shape, log-grid gradients.
        "deltas": {**WEIGHT_DELTAS, **LOG_GRID_GRADIENTS},
        # Between zero++ and deltas, to attribute what deltas costs where the link is fast.
        "deltas-uniform-gradients": WEIGHT_DELTAS,
        # ZeRO++'s INT8 ring weights with the log grid's gradients: a best-quality
        # candidate at zero++'s cost.
        "zero++-log-grid": {**zero_pp, **LOG_GRID_GRADIENTS},
        "zero++-int8-intra-gradients": {**zero_pp, "gradient_bits_intra_node": 8},
        "zero++-int4-log-gradients": {**zero_pp, "gradient_grid_inter_node": "log"},
    }
