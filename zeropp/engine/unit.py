"""A unit at run time: its module and its flat parameters (trainable and frozen apart)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..sharding import FlatParam, ShardState


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    flats: list[FlatParam]
    is_root: bool

    def state(self) -> ShardState:
        states = {flat.state for flat in self.flats}
        if ShardState.GATHERING in states:
            return ShardState.GATHERING
        return states.pop() if len(states) == 1 else ShardState.SHARDED

    def install_views(self) -> None:
        for flat in self.flats:
            flat.install_views()
