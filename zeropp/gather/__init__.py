"""Weight gathers, one strategy per file (docs/design.md section 4), and the one place
that maps a config onto them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ZeroConfig
from .base import WeightGather
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
    if config.two_hop_weight_gather:
        primary = TwoHopGather(config, topology, communicator)
    elif config.quantized_weights:
        primary = QuantizedGather(config, topology, communicator)
    else:
        primary = PlainGather(config, topology, communicator)
    if config.hpz_size > 1:
        return SecondaryGather(primary, config, topology, communicator)
    return primary


__all__ = ["PlainGather", "QuantizedGather", "SecondaryGather", "TwoHopGather", "WeightGather", "select_weight_gather"]
