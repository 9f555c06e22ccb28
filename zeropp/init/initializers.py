"""Random initialisation of a meta-device module, one unit at a time, independent of the
world size: every rank runs the module's own initialisation on the unit's full-size
parameters, seeded by (seed, unit index), and keeps its shard."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..sharding import ParamInfo
from ..sharding.flat_param import Slot, shard_of_params
from .base import ModuleInit, WeightSource, check_written, default_module_init, empty_like_meta, materialize_buffers


class RunInitializers(WeightSource):
    """``init_fn(module)`` is called on every module of a unit, children before parents (as
    ``nn.Module.apply``); by default a Hugging Face model's ``_init_weights`` or each
    module's ``reset_parameters``. The same ``seed`` gives the same weights at any world size."""

    def __init__(self, seed: int = 0, init_fn: ModuleInit | None = None) -> None:
        self.seed = seed
        self.init_fn = init_fn

    def prepare_unit(self, index: int, modules: list[nn.Module], params: list[ParamInfo]) -> None:
        initialize = self.init_fn or default_module_init(self.root)
        for info in params:  # the unit's own parameters, full size, for the length of this call
            if info.param.is_meta:
                real = nn.Parameter(empty_like_meta(info.param, self.device), requires_grad=info.param.requires_grad)
                for use in info.uses:
                    use.module._parameters[use.attr] = real
                info.param = real
        buffers = {id(module): materialize_buffers(module, self.device) for module in modules}
        foreign = _stand_ins(modules, self.device)
        with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(self.device)):
            torch.manual_seed(_unit_seed(self.seed, index))
            for module in modules:
                initialize(module)
        for module, attr, original in foreign:
            module._parameters[attr] = original
        how = "its initialisation"
        for info in params:
            check_written(f"parameter {info.names[0]}", info.param, how)
        for module in modules:
            for attr in buffers[id(module)]:
                check_written(f"buffer {self.buffer_name(module, attr)}", module._buffers[attr], how)

    def shard(self, params: list[ParamInfo], slots: list[Slot], start: int, shard_numel: int) -> torch.Tensor:
        return shard_of_params(params, slots, start, shard_numel, self.device)


def _stand_ins(modules: list[nn.Module], device: torch.device) -> list[tuple[nn.Module, str, object]]:
    """Parameters a module reads that belong to another unit (still meta, or already moved
    into that unit's shards) get a scratch tensor for the initialiser to write into; the
    owning unit's own initialisation is what counts."""
    replaced = []
    for module in modules:
        for attr, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                replaced.append((module, attr, param))
                module._parameters[attr] = nn.Parameter(empty_like_meta(param, device), requires_grad=False)
    return replaced


def _unit_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []
