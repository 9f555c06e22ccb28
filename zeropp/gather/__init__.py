"""Weight gathers, one strategy per file (docs/design.md section 4), and the one place
that maps a config onto them."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..config import ZeroConfig
from .base import WeightGather
from .by_trainability import ByTrainability, ResidentSecondary
from .delta import DeltaGather
from .plain import PlainGather
from .quantized import QuantizedGather
from .secondary import SecondaryGather
from .two_hop import TwoHopGather

if TYPE_CHECKING:
    from ..collectives import Communicator
    from ..topology import Topology


def select_weight_gather(config: ZeroConfig, topology: "Topology | None" = None,
                         communicator: "Communicator | None" = None) -> WeightGather:
    """The gather ``config`` asks for. Without a topology and communicator it can only
    predict bytes (the accounting and the planner use it that way)."""
    if config.weight_deltas:
        # Its copies of frozen flats are never invalidated: after the first gather they stay
        # inside the node, exact, which is what MixZ++ would give them.
        return DeltaGather(config, topology, communicator)
    if config.two_hop_weight_gather:
        primary = TwoHopGather(config, topology, communicator)
    elif config.quantized_weights:
        primary = QuantizedGather(config, topology, communicator)
    else:
        primary = PlainGather(config, topology, communicator)
    if config.hpz_size > 1:
        primary = SecondaryGather(primary, config, topology, communicator)
    if config.quantized_nontrainable_weights:
        return ByTrainability(primary, _frozen_gather(config, topology, communicator))
    return primary


def _frozen_gather(config: ZeroConfig, topology, communicator) -> WeightGather:
    """MixZ++: frozen flats gathered quantized, their hpZ copy kept inside the node for good."""
    quantized = replace(config, quantized_weights=True, two_hop_weight_gather=False, weight_deltas=False)
    gather = QuantizedGather(quantized, topology, communicator)
    if config.hpz_size > 1:
        return ResidentSecondary(gather, quantized, topology, communicator)
    return gather


__all__ = ["ByTrainability", "DeltaGather", "PlainGather", "ResidentSecondary", "QuantizedGather", "SecondaryGather", "TwoHopGather", "WeightGather", "select_weight_gather"]
