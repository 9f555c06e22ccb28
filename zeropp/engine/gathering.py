"""Moving units between their resting shards and their gathered full weights.

A flat rests SHARDED (or SECONDARY, when the weight gather keeps a node-local copy: hpZ),
becomes GATHERING when its gather is launched and GATHERED once it has arrived; freeing
returns it to its resting state (docs/design.md sections 2 and 3). The weight gather in force is
looked up at each call: auto mode and the schedule may switch it between steps.
"""

from __future__ import annotations

from ..config import ZeroConfig
from ..sharding import FlatParam, ShardState
from .schedule import ExecutionOrder
from .strategies import Strategies
from .unit import Unit


class UnitGathering:
    """Gathers, prefetches and frees the units of one model (its hooks call these)."""

    def __init__(self, units: list[Unit], strategies: Strategies, config: ZeroConfig) -> None:
        self._units = units
        self._strategies = strategies
        self._config = config

    def start(self, unit: Unit, phase: str) -> None:
        """Launch the gathers of ``unit``'s resting flats (``phase`` names them in the log)."""
        for flat in unit.flats:
            if flat.state in (ShardState.SHARDED, ShardState.SECONDARY):
                flat.allocate_full()
                flat.pending_gather = self._strategies.weight_gather.start(flat, phase)
                flat.state = ShardState.GATHERING

    def finish(self, flat: FlatParam) -> None:
        if flat.state is ShardState.GATHERING:
            self._strategies.weight_gather.finish(flat, flat.pending_gather)
            flat.pending_gather = None
            flat.state = ShardState.GATHERED

    def ensure(self, unit: Unit, phase: str) -> None:
        """``unit`` gathered on return, whether it was resting or its prefetch in flight."""
        self.start(unit, phase)
        for flat in unit.flats:
            self.finish(flat)

    def prefetch(self, order: ExecutionOrder, unit: Unit, phase: str) -> None:
        """Launch the gathers of the units that ran after ``unit`` last time."""
        if not self._config.prefetch:
            return
        for following in order.following(unit.index, self._config.prefetch_units):
            self.start(self._units[following], phase)

    def free_gathered(self, flat: FlatParam) -> None:
        if flat.state is ShardState.GATHERED:
            flat.free_full(self.resting_state(flat))

    def free(self, unit: Unit) -> None:
        for flat in unit.flats:
            self.finish(flat)  # never free storage under a collective in flight
            self.free_gathered(flat)

    def free_all(self) -> None:
        for unit in self._units:
            self.free(unit)

    def resting_state(self, flat: FlatParam) -> ShardState:
        return ShardState.SECONDARY if self._strategies.weight_gather.holds_copy(flat) else ShardState.SHARDED
