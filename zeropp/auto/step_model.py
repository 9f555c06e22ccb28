"""An analytic model of one training step's time: compute plus the communication that
compute cannot hide (docs/design.md section 11). ``zeropp plan`` and auto mode share it.

    link     = bytes a node's link carries in per optimizer step / inter-node bandwidth
               + bytes a node's ranks receive from each other / intra-node bandwidth
               + collectives per step x latency
    exposed  = max(0, link - overlap * compute) + link / (flats + 1)
    step     = compute + exposed

A step is one optimizer step: with gradient accumulation over k micro-steps, compute and
bytes are those of all k (node accumulation's gradients cross nodes once, and the weights
too where hpZ keeps a copy inside the node). The last term of ``exposed`` is the first
flat's gather, which nothing can overlap;
``overlap`` is the share of compute that prefetching and asynchronous reduction hide
communication behind. Bytes come from the same analytic volume the accounting is tested
against (:func:`zeropp.accounting.predicted_step_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..accounting import FlatSummary, predicted_step_bytes
from ..config import ZeroConfig
from ..gather import select_weight_gather
from ..reduce import select_gradient_reduction
from ..topology import Layout

OVERLAP = 0.9


@dataclass(frozen=True)
class LinkSpeeds:
    """A cluster's links as the model sees them (measured by :mod:`zeropp.auto.probe`)."""

    inter_node_bytes_per_s: float  # what one node's link carries in
    intra_node_bytes_per_s: float = math.inf  # what a node's ranks receive from each other, together
    latency_s: float = 50e-6  # per step of a ring or all-to-all (each of the G - 1 exchanges)


@dataclass(frozen=True)
class Accumulation:
    """How many micro-steps one optimizer step runs, and whether the first k - 1 reduce
    inside the node only (``model.no_sync()``: node accumulation) or across nodes too."""

    micro_steps: int = 1
    node_accumulation: bool = False


@dataclass(frozen=True)
class LinkTime:
    seconds: float
    inter_node_bytes: int  # per step into node 0, all its ranks together
    intra_node_bytes: int


def link_time(flats: list[FlatSummary], layout: Layout, config: ZeroConfig, links: LinkSpeeds,
              backend: str = "gloo", accumulation: Accumulation = Accumulation()) -> LinkTime:
    """Seconds node 0's links are busy during one optimizer step of ``config``."""
    inter = intra = 0
    for rank in range(layout.ranks_per_node):  # node 0's ranks
        for row in predicted_step_bytes(flats, layout, config, rank, backend, accumulation.micro_steps,
                                        accumulation.node_accumulation).values():
            inter += row["received_inter_node"]
            intra += row["received_intra_node"]
    gather = select_weight_gather(config)
    steps = (gather.collective_steps(layout, "forward_gather") + gather.collective_steps(layout, "backward_gather")
             + select_gradient_reduction(config).collective_steps(layout))
    seconds = (inter / links.inter_node_bytes_per_s + intra / links.intra_node_bytes_per_s
               + len(flats) * steps * accumulation.micro_steps * links.latency_s)
    return LinkTime(seconds, inter, intra)


def step_seconds(compute_s: float, link_s: float, num_flats: int, overlap: float = OVERLAP) -> float:
    """One step's time when compute takes ``compute_s`` and the links ``link_s``."""
    exposed = max(0.0, link_s - overlap * compute_s) + link_s / (num_flats + 1)
    return compute_s + exposed
