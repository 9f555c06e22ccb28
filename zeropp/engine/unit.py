"""A unit at run time: its module and its flat parameters (trainable and frozen apart)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..sharding import FlatParam


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    flats: list[FlatParam]
    is_root: bool

    def install_views(self, on_last_use=None) -> None:
        for flat in self.flats:
            flat.install_views(on_last_use)
