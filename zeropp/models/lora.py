"""Low-rank adapters (LoRA) of our own: ``y = base(x) + (alpha / rank) * B(A(x))`` with the
base ``nn.Linear`` frozen and A, B trained. Wrapped by ShardedModel, the base weights form
a frozen flat of each unit (INT8 and resident in the node under MixZ++) and the adapters a
small trainable one."""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)  # A
        self.up = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)  # B
        self.scale = alpha / rank
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A as nn.Linear's default, B zero: the adapted model starts equal to the base."""
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.up(self.down(x))


def add_lora(model: nn.Module, target_suffixes: tuple[str, ...], rank: int = 8, alpha: float = 16.0) -> list[str]:
    """Freeze every parameter of ``model`` and wrap each ``nn.Linear`` whose name ends with
    one of ``target_suffixes`` in a :class:`LoRALinear`; returns the wrapped names. Call
    before ShardedModel."""
    for param in model.parameters():
        param.requires_grad_(False)
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.endswith(target_suffixes)]
    if not targets:
        linear = sorted(name for name, module in model.named_modules() if isinstance(module, nn.Linear))
        raise ValueError(f"no nn.Linear ends with {list(target_suffixes)}; the model's are {linear[:10]}")
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(module, rank, alpha))
    return [name for name, _ in targets]
