"""The engine's checks of what users hand it: the module, its unit classes, the weight
source and each forward's inputs. Each mistake is a ValueError that says what to do."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..init import WeightSource
from ..sharding import auto_unit_classes

logger = logging.getLogger(__name__)


def check_inputs(device: torch.device, args: tuple, kwargs: dict) -> None:
    """Errors that would otherwise surface deep inside a unit, or as a NaN loss."""
    named = [(f"argument {index}", value) for index, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            continue
        if value.device != device:
            raise ValueError(f"input {name} is on {value.device}, this rank's shards on {device}; "
                             f"move the batch with .to({str(device)!r})")
        if value.dim() >= 1 and value.shape[0] == 0:
            raise ValueError(f"input {name} has an empty batch (shape {tuple(value.shape)}); every rank takes "
                             "part in every step's collectives and needs at least one sample")


def check_weight_source(module: nn.Module, init: WeightSource | None, device: torch.device) -> WeightSource | None:
    on_meta = [name for name, param in module.named_parameters() if param.is_meta]
    if init is None:
        if on_meta:
            raise ValueError(f"{len(on_meta)} parameters are on the meta device (first: {on_meta[0]}); pass "
                             "init=zeropp.init.RunInitializers(seed=...) to initialise them unit by unit, or "
                             "init=zeropp.init.LoadSafetensors(path) to load pretrained weights into the shards")
        return None
    if not isinstance(init, WeightSource):
        raise ValueError(f"init={init!r}: give a zeropp.init.RunInitializers or zeropp.init.LoadSafetensors")
    if len(on_meta) != len(list(module.parameters())):
        raise ValueError("init=... fills a module built on the meta device (with torch.device('meta'): ...); "
                         "this one has real parameters, which would be ignored; drop init= to keep them")
    init.bind(module, device)
    return init


def resolve_unit_classes(module: nn.Module, unit_classes) -> tuple[type, ...]:
    if isinstance(unit_classes, str):
        if unit_classes != "auto":
            raise ValueError(f"unit_classes={unit_classes!r}: give module classes or \"auto\"")
        return auto_unit_classes(module)
    return tuple(unit_classes)


def check_unit_classes(module: nn.Module, unit_classes: tuple[type, ...], num_units: int) -> None:
    if num_units > 1:
        return
    if unit_classes:
        found = sorted({type(child).__name__ for child in module.modules()})
        raise ValueError(f"unit_classes={[c.__name__ for c in unit_classes]} match no submodule of "
                         f"{type(module).__name__}; its module classes are {found}")
    logger.warning("%s wraps as a single unit (no unit_classes): every step gathers the whole model at once; "
                   "name its block class in unit_classes", type(module).__name__)
