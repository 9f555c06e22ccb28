"""Building a wrapped model's units: each rank takes its shard of every parameter (from the
module, a broadcast from rank 0, or a weight source that reads only the shard), then frees
the full-size values before the unit's buffers exist."""

from __future__ import annotations

import torch
from torch import nn

from ..collectives import Communicator
from ..config import ZeroConfig
from ..init import WeightSource
from ..sharding import FlatParam, plan_units
from ..sharding.flat_param import flatten_params, make_slots, shard_numel_for, shard_of_params
from ..sharding.units import modules_by_unit
from ..topology import Topology
from .checks import check_unit_classes
from .unit import Unit


class UnitBuilder:
    def __init__(self, topology: Topology, config: ZeroConfig, communicator: Communicator,
                 weight_source: WeightSource | None) -> None:
        self.topology = topology
        self.config = config
        self.communicator = communicator
        self.weight_source = weight_source  # holds file handles and the meta module: drop the builder after use

    def build(self, module: nn.Module, unit_classes: tuple[type, ...]) -> list[Unit]:
        """The units of ``module``; its parameters are freed as they are sharded."""
        specs = plan_units(module, unit_classes)
        check_unit_classes(module, unit_classes, len(specs))
        modules = modules_by_unit(specs)
        units = []
        for index, spec in enumerate(specs):
            if self.weight_source is not None:
                self.weight_source.prepare_unit(index, modules[index], spec.params)
            shards = []  # (name, requires_grad, slots, shard): this rank's values, taken first ...
            for requires_grad in (True, False):
                params = [p for p in spec.params if p.param.requires_grad == requires_grad]
                if params:
                    shards.append((f"{spec.name}:{requires_grad}", requires_grad, *self._shard_values(params)))
            for _, _, slots, _ in shards:
                for slot in slots:
                    for use in slot.uses:
                        # Views of the gathered buffer replace it at every forward.
                        del use.module._parameters[use.attr]
            spec.params.clear()  # ... so the unit's full-size values are freed before its buffers exist
            flats = [FlatParam(name, requires_grad, slots, shard, self.topology.rank, self.topology.world_size,
                               self.config.compute_torch_dtype) for name, requires_grad, slots, shard in shards]
            units.append(Unit(index, spec.name, spec.module, flats, is_root=index == 0))
        return units

    def _shard_values(self, params) -> tuple[list, torch.Tensor]:
        """The flat layout of ``params`` and this rank's shard of it ([shard_numel] fp32)."""
        world_size, rank = self.topology.world_size, self.topology.rank
        slots = make_slots(params, self.config.parameter_alignment)
        extent = slots[-1].offset + slots[-1].numel
        shard_numel = shard_numel_for(extent, world_size, self.config.effective_shard_alignment)
        start = rank * shard_numel
        if self.weight_source is not None:  # the same values on every rank by construction
            return slots, self.weight_source.shard(params, slots, start, shard_numel)
        if self.config.sync_module_states:
            full = flatten_params(params, slots, shard_numel * world_size, self.topology.device)
            self.communicator.broadcast(full, self.topology.group("world"), source_rank=0, phase="init")
            return slots, full[start : start + shard_numel].clone()
        return slots, shard_of_params(params, slots, start, shard_numel, self.topology.device)
