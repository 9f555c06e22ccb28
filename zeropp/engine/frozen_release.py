"""Freeing a unit's frozen weights in backward as soon as nothing needs them.

A trainable flat is freed when autograd has all its parameter gradients (the split
pre-hook, see ``FlatParam.install_views``). A frozen flat has no gradient to tell when its
values were last used; without this it stayed gathered until the end of backward, so a
frozen base (MixZ++, LoRA) had every unit gathered at once by then.

Frozen values are used by the operations between the unit's inputs and outputs. Once the
gradients of the unit's inputs are computed, and those of its trainable flat (if it has
one), every such operation's backward has run. The inputs are passed through an identity
function whose backward marks that moment (as FSDP2 does for its post-backward). A unit
called several times in one forward waits for all its calls; a unit whose inputs need no
gradient keeps its frozen values until the end of backward, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..sharding import FlatParam
from .unit import Unit


class _InputGradientsReady(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_ready, *tensors):
        ctx.on_ready = on_ready
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *gradients):
        ctx.on_ready()
        return (None, *gradients)


class FrozenRelease:
    def __init__(self, units: list[Unit], free: Callable[[FlatParam], None]) -> None:
        self._free = free
        self._unit_of = {flat.name: unit for unit in units for flat in unit.flats}
        self._pending: dict[int, int] = {}  # unit index -> forwards whose input gradients are pending
        self._trainable_done: set[int] = set()  # units whose trainable flat had its last use

    def wrap_inputs(self, unit: Unit, args: tuple) -> tuple | None:
        """In a forward with grad enabled: ``args`` with its tensors that need a gradient
        passed through the marker, or None when there is nothing to do."""
        if unit.is_root or all(flat.requires_grad for flat in unit.flats):
            return None
        positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor) and arg.requires_grad]
        if not positions:
            return None
        self._pending[unit.index] = self._pending.get(unit.index, 0) + 1
        marked = _InputGradientsReady.apply(lambda: self._inputs_done(unit), *(args[i] for i in positions))
        args = list(args)
        for position, tensor in zip(positions, marked):
            args[position] = tensor
        return tuple(args)

    def trainable_done(self, flat: FlatParam) -> None:
        """``flat``'s parameter gradients are all computed (its last use)."""
        unit = self._unit_of[flat.name]
        self._trainable_done.add(unit.index)
        if self._pending.get(unit.index) == 0:
            self._release(unit)

    def _inputs_done(self, unit: Unit) -> None:
        self._pending[unit.index] -= 1
        trainable = [flat for flat in unit.flats if flat.requires_grad]
        if self._pending[unit.index] == 0 and (not trainable or unit.index in self._trainable_done):
            self._release(unit)

    def _release(self, unit: Unit) -> None:
        for flat in unit.flats:
            if not flat.requires_grad:
                self._free(flat)

    def reset(self) -> None:
        """Backward ended: forwards never differentiated no longer count."""
        self._pending.clear()
        self._trainable_done.clear()
