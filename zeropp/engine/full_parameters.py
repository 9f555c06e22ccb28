"""Every parameter of a wrapped model, whole, for reading or editing (as FSDP's
``summon_full_params`` and DeepSpeed's ``GatheredParameters``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def full_parameters(model, writeback: bool = True, rank0_only: bool = False) -> Iterator[None]:
    """Collective. Inside the block the wrapped module's parameters are whole fp32
    ``nn.Parameter`` s under their usual names (on every rank, or on rank 0 only); edits made
    to them are written back into the shards on exit when ``writeback`` (rank 0's edits when
    ``rank0_only``). Needs the whole model's fp32 size in memory on the ranks that hold it."""
    model._gathering.free_all()  # no gathered compute-dtype buffers alongside the fp32 copies
    holds = not rank0_only or model.topology.rank == 0
    buffers = []
    for flat in model.flat_params():
        gathered = model.gather_master(flat, "full_parameters")
        buffers.append(gathered)
        if holds:
            _install(flat, gathered)
    try:
        with torch.no_grad():
            yield
    finally:
        for flat, gathered in zip(model.flat_params(), buffers):
            if holds:
                _remove(flat)
            if writeback:
                _write_back(model, flat, gathered, rank0_only)
        if writeback:
            model.on_weights_changed(include_frozen=True)


def _install(flat, gathered: torch.Tensor) -> None:
    for slot in flat.slots:
        parameter = nn.Parameter(gathered[slot.offset : slot.offset + slot.numel].view(slot.shape),
                                 requires_grad=flat.requires_grad)
        for use in slot.uses:
            setattr(use.module, use.attr, parameter)


def _remove(flat) -> None:
    for slot in flat.slots:
        for use in slot.uses:
            del use.module._parameters[use.attr]


def _write_back(model, flat, gathered: torch.Tensor, rank0_only: bool) -> None:
    if rank0_only:
        model.communicator.broadcast(gathered, model.topology.group("world"), source_rank=0, phase="full_parameters")
    start = model.topology.rank * flat.shard_numel
    with torch.no_grad():
        flat.master.copy_(gathered[start : start + flat.shard_numel])
