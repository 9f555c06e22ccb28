"""Gradient reductions, one strategy per file (docs/design.md section 5), and the one
place that maps a config onto them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ZeroConfig
from .base import GradientReduction
from .plain import PlainReduction
from .qgz import QgzBucket, QgzReduction
from .qgz_bf16_scales import QgzBf16ScalesReduction

if TYPE_CHECKING:
    from ..collectives import Communicator
    from ..topology import Topology


def select_gradient_reduction(config: ZeroConfig, topology: "Topology | None" = None,
                              communicator: "Communicator | None" = None) -> GradientReduction:
    """The reduction ``config`` asks for. Without a topology and communicator it can only
    predict bytes (the accounting and the planner use it that way)."""
    if config.quantized_gradients and config.gradient_scale_dtype == "bf16":
        return QgzBf16ScalesReduction(config, topology, communicator)
    if config.quantized_gradients:
        return QgzReduction(config, topology, communicator)
    return PlainReduction(config, topology, communicator)


__all__ = ["GradientReduction", "PlainReduction", "QgzBf16ScalesReduction", "QgzBucket", "QgzReduction",
           "select_gradient_reduction"]
