"""The communication strategies in force, and when they change: ``late_bits_from_step``
switches settings at a training step, auto mode after its trials (docs/design.md section 7)."""

from __future__ import annotations

from ..auto import Accumulation, AutoTuner
from ..collectives import Communicator
from ..config import ZeroConfig
from ..gather import select_weight_gather
from ..reduce import select_gradient_reduction
from ..topology import Topology


class Strategies:
    """Holds the settings now in force (``active_config``) and the weight gather and
    gradient reduction built from them; ``update`` rebuilds both when the settings change."""

    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config = config
        self.topology = topology
        self.communicator = communicator
        self.training_step = 0
        self._forwards = 0  # training forwards (micro-steps) since the last optimizer step
        self.auto = AutoTuner(config, topology, communicator) if config.auto else None
        self.active_config = self._in_force()
        self.weight_gather = select_weight_gather(self.active_config, topology, communicator)
        self.gradient_reduction = select_gradient_reduction(self.active_config, topology, communicator)

    def _in_force(self) -> ZeroConfig:
        active = self.config.at_step(self.training_step)
        return self.auto.applied_to(active) if self.auto else active

    def update(self) -> bool:
        """Rebuild the strategies if the settings in force changed; True if they did (the
        caller must then drop every copy the old weight gather kept)."""
        active = self._in_force()
        if active == self.active_config:
            return False
        self.active_config = active
        self.weight_gather = select_weight_gather(active, self.topology, self.communicator)
        previous, self.gradient_reduction = self.gradient_reduction, select_gradient_reduction(
            active, self.topology, self.communicator)
        self.gradient_reduction.carry_state_from(previous)  # error-feedback residuals survive
        return True

    def tune(self, flat_summaries, optimizer_stepped: bool, node_accumulation: bool) -> bool:
        """Auto mode's turn before each training forward (it acts at an optimizer step's
        first, knowing how many micro-steps the last one ran, and whether under
        ``no_sync``: ``node_accumulation``); True if the settings changed."""
        if self.auto is None:
            return False
        if not (optimizer_stepped or self.auto.state is None):
            self._forwards += 1
            return False
        accumulation = Accumulation(max(1, self._forwards), node_accumulation)
        self._forwards = 1
        return self.auto.before_step(flat_summaries, accumulation) and self.update()
