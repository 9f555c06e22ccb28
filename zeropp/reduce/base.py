"""What every gradient reduction provides (docs/design.md section 5).

A reduction turns a unit's full local gradient [W * S] into this rank's mean shard [S]
fp32, the layout a reduce-scatter gives. ``start`` returns a
:class:`PendingReduction`. ``predicted_bytes`` is the analytic volume of one reduction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..traffic import Traffic
from ..config import ZeroConfig
from ..topology import Layout

if TYPE_CHECKING:
    from ..collectives import Communicator
    from ..topology import Topology


class PendingReduction(Protocol):
    """One unit's reduction in flight."""

    def progress(self) -> bool:
        """Launch what can be launched now (reductions of several units overlap); True
        when nothing is left to launch."""

    def release(self) -> bool:
        """Wait for what holds the full-size buffers and leave only a last hop in flight,
        so the queue of reductions in flight can take the next one; True if it did, False
        where the reduction has no such hop."""

    def wait(self) -> torch.Tensor | None:
        """This rank's mean shard [S] fp32 (None: a micro-step without sync kept its sums
        inside the node)."""


class GradientReduction:
    def __init__(self, config: ZeroConfig, topology: "Topology | None" = None,
                 communicator: "Communicator | None" = None) -> None:
        self.config = config
        self.topology = topology
        self.comm = communicator

    def start(self, flat_grad: torch.Tensor, label: str = "") -> PendingReduction:
        """``flat_grad`` [W * S] -> pending; ``pending.wait()`` is the mean shard [S] fp32."""
        raise NotImplementedError

    def carry_state_from(self, previous: "GradientReduction") -> None:
        """Take over what ``previous`` kept between steps (the config switched mid-run)."""

    def held_bytes(self, shard_numel: int, layout: Layout, backend: str = "gloo") -> int:
        """Bytes one reduction in flight holds until it is finished: the full-size gradient
        it was given when its collective reads it, and its own buffers."""
        raise NotImplementedError

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, backend: str = "gloo") -> Traffic:
        """Bytes ``rank`` receives for one reduction of a flat of ``shard_numel`` values per rank."""
        raise NotImplementedError

    def collective_steps(self, layout: Layout) -> int:
        """Sequential exchanges per reduction, for the planner's latency term."""
        raise NotImplementedError
