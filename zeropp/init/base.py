"""Where a wrapped module's starting weights come from when it was built on the meta device.

A ``WeightSource`` is asked, unit by unit, for this rank's shard of each flat buffer, so no
rank ever holds more than one unit's worth of full weights (docs/design.md section 9).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from ..sharding import ParamInfo
from ..sharding.flat_param import Slot

ModuleInit = Callable[[nn.Module], None]


class WeightSource(ABC):
    """Fills meta-device parameters with real values, one unit at a time."""

    def bind(self, root: nn.Module, device: torch.device) -> None:
        """Called once before the first unit, with the whole (meta) module and this rank's device."""
        self.root = root
        self.device = device
        self.module_names = {id(module): name for name, module in root.named_modules(remove_duplicate=False)}

    @abstractmethod
    def prepare_unit(self, index: int, modules: list[nn.Module], params: list[ParamInfo]) -> None:
        """Before the unit's flat buffers are built: give its modules' meta buffers values,
        and, if this source needs them, its parameters."""

    @abstractmethod
    def shard(self, params: list[ParamInfo], slots: list[Slot], start: int, shard_numel: int) -> torch.Tensor:
        """Positions [start, start + shard_numel) of the flat buffer of ``params``:
        [shard_numel] fp32 on this rank's device, zero where padding."""

    def buffer_name(self, module: nn.Module, attr: str) -> str:
        prefix = self.module_names[id(module)]
        return f"{prefix}.{attr}" if prefix else attr


def default_module_init(root: nn.Module) -> ModuleInit:
    """What eager construction does to each module: its ``reset_parameters()`` (what
    ``nn.Linear``, ``nn.LayerNorm``, ... run in their constructors), then the model's
    ``root._init_weights(module)`` when it has one (Hugging Face models and the built-in GPT
    apply it after construction)."""
    own = getattr(root, "_init_weights", None)

    def initialize(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if own is not None:
            own(module)

    return initialize


def empty_like_meta(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor for a meta one, filled with NaN so that anything no initialiser wrote
    is caught afterwards (integer tensors cannot hold NaN and start at zero)."""
    if tensor.dtype.is_floating_point:
        return torch.full(tensor.shape, float("nan"), dtype=tensor.dtype, device=device)
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)


def materialize_buffers(module: nn.Module, device: torch.device) -> list[str]:
    """Replace ``module``'s own meta buffers with NaN-filled ones; their attribute names."""
    names = []
    for attr, buffer in module._buffers.items():
        if buffer is not None and buffer.is_meta:
            module._buffers[attr] = empty_like_meta(buffer, device)
            names.append(attr)
    return names


def check_written(name: str, tensor: torch.Tensor, how: str) -> None:
    if tensor.dtype.is_floating_point and torch.isnan(tensor).any():
        raise ValueError(f"{name} was built on the meta device and {how} did not set it (NaN remain); "
                         "pass init_fn=... to RunInitializers, or load it from a checkpoint")
