"""One unit's parameters as a flat, padded buffer sharded over the world.

Layout of the full buffer, ``padded_numel = world_size * shard_numel`` elements::

    [ p0.flatten() | p1.flatten() | ... | zero padding ]
      rank 0's shard = [0, shard_numel), rank 1's = [shard_numel, 2 * shard_numel), ...

Each rank keeps its shard as an fp32 master ``nn.Parameter`` (what the optimizer steps) and,
when the compute dtype is narrower, a compute-dtype copy that is what the all-gather sends.
``full`` is the gathered buffer in the compute dtype; the module's parameters are views of
it while the unit is gathered. Its storage is resized to zero when the unit is freed, so the
views saved by autograd come back to life when the storage is refilled for backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn

from .units import ParamInfo, ParamUse


class ShardState(Enum):
    """Where a flat parameter's values are (docs/design.md section 3)::

        SHARDED --start--> GATHERING --finish--> GATHERED --free--> SHARDED or SECONDARY
        SECONDARY --start--> GATHERING (inside the hpZ group)
        SECONDARY --optimizer step--> SHARDED
    """

    SHARDED = auto()  # only the shard exists; full has no storage
    SECONDARY = auto()  # as SHARDED, and hpZ keeps a part of the last gathered buffer in the node
    GATHERING = auto()  # an all-gather into full is in flight
    GATHERED = auto()  # full holds every rank's values


@dataclass(frozen=True)
class Slot:
    """Where one original parameter lives inside the flat buffer."""

    names: tuple[str, ...]
    uses: tuple[ParamUse, ...]
    shape: torch.Size
    offset: int
    numel: int


def shard_numel_for(total_numel: int, world_size: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` such that ``world_size`` shards cover the values."""
    per_rank = math.ceil(total_numel / world_size)
    return max(alignment, math.ceil(per_rank / alignment) * alignment)


def make_slots(params: list[ParamInfo], alignment: int) -> list[Slot]:
    """Place parameters one after another, each starting at a multiple of ``alignment``.

    With quantization the alignment is the block size, so no quantization block mixes two
    parameters: a LayerNorm gain of 1.0 sharing a block with weights of 0.02 would leave
    those weights only a few quantization levels.
    """
    slots, offset = [], 0
    for info in params:
        offset = math.ceil(offset / alignment) * alignment
        numel = info.param.numel()
        slots.append(Slot(tuple(info.names), tuple(info.uses), info.param.shape, offset, numel))
        offset += numel
    return slots


def flatten_params(params: list[ParamInfo], slots: list[Slot], padded_numel: int,
                   device: torch.device) -> torch.Tensor:
    """The fp32 full buffer of ``params`` with zero padding, shape [padded_numel]."""
    flat = torch.zeros(padded_numel, dtype=torch.float32, device=device)
    for info, slot in zip(params, slots):
        flat[slot.offset : slot.offset + slot.numel].copy_(info.param.detach().reshape(-1))
    return flat


def slot_pieces(slots: list[Slot], start: int, stop: int) -> list[tuple[Slot, int, int]]:
    """``(slot, first, last)`` for every slot overlapping positions [start, stop) of the flat
    buffer: elements [first, last) of the flattened parameter lie in that range."""
    pieces = []
    for slot in slots:
        first, last = max(start, slot.offset) - slot.offset, min(stop, slot.offset + slot.numel) - slot.offset
        if first < last:
            pieces.append((slot, first, last))
    return pieces


def shard_of_params(params: list[ParamInfo], slots: list[Slot], start: int, shard_numel: int,
                    device: torch.device) -> torch.Tensor:
    """Positions [start, start + shard_numel) of the flat buffer of ``params``, without
    building the whole buffer: [shard_numel] fp32, zero where padding."""
    shard = torch.zeros(shard_numel, dtype=torch.float32, device=device)
    values = {id(slot): info.param for info, slot in zip(params, slots)}
    for slot, first, last in slot_pieces(slots, start, start + shard_numel):
        position = slot.offset + first - start
        shard[position : position + last - first].copy_(values[id(slot)].detach().reshape(-1)[first:last])
    return shard


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter in this rank's shard: elements [first, first + numel) of the
    flattened parameter, at [begin, begin + numel) of the master shard."""

    slot: Slot
    first: int
    begin: int
    parameter: nn.Parameter  # 1-D view of the master shard, [numel] fp32


class FlatParam:
    """Shard state and buffers of the parameters of one unit that share ``requires_grad``."""

    def __init__(
        self,
        name: str,
        requires_grad: bool,
        slots: list[Slot],
        shard: torch.Tensor,
        rank: int,
        world_size: int,
        compute_dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.requires_grad = requires_grad
        self.compute_dtype = compute_dtype
        self.shard_numel = shard.numel()
        self.padded_numel = shard.numel() * world_size
        self.slots = slots
        self.numel = sum(slot.numel for slot in self.slots)  # real values, padding excluded
        # Split sizes of the full buffer: [gap, parameter, gap, parameter, ..., tail padding].
        self._split_sizes, end = [], 0
        for slot in slots:
            self._split_sizes += [slot.offset - end, slot.numel]
            end = slot.offset + slot.numel
        self._split_sizes.append(self.padded_numel - end)

        self.start = rank * self.shard_numel  # where this rank's shard begins in the full buffer
        self.master = nn.Parameter(shard, requires_grad=self.requires_grad)  # [shard_numel] fp32
        # This rank's piece of each original parameter (empty where it holds none), views of
        # the master shard sharing its storage: what ``ShardedModel.named_parameters`` yields.
        self.local_pieces = [self._local_piece(slot) for slot in slots]
        self._compute_shard = None if compute_dtype == torch.float32 else shard.to(compute_dtype)

        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=shard.device)
        self.full.untyped_storage().resize_(0)
        if self.requires_grad:
            self.full.requires_grad_(True)
        # Writes through this alias do not bump autograd's version counter of ``full``, so
        # refilling the storage before backward does not invalidate saved views.
        self.full_data = self.full.data
        self.state = ShardState.SHARDED
        self.pending_gather = None
        self.uses_in_graph = 0  # forwards whose parameter views autograd has not yet differentiated
        self.seen_version = self.master._version  # the master's version when last refreshed

    def _local_piece(self, slot: Slot) -> LocalPiece:
        stop = self.start + self.shard_numel
        first = min(max(self.start, slot.offset), slot.offset + slot.numel) - slot.offset
        last = max(min(stop, slot.offset + slot.numel), slot.offset + first) - slot.offset
        begin = min(max(slot.offset + first - self.start, 0), self.shard_numel)
        view = self.master.detach()[begin : begin + last - first]
        return LocalPiece(slot, first, begin, nn.Parameter(view, requires_grad=self.requires_grad))

    def compute_shard(self) -> torch.Tensor:
        """What this rank contributes to the all-gather, [shard_numel] compute dtype."""
        if self._compute_shard is None:
            return self.master.detach()
        return self._compute_shard

    def refresh_compute_shard(self) -> None:
        """The master shard changed: bring the compute-dtype copy up to date."""
        if self._compute_shard is not None:
            self._compute_shard.copy_(self.master.detach())

    def allocate_full(self) -> None:
        nbytes = self.padded_numel * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def free_full(self, state: ShardState = ShardState.SHARDED) -> None:
        """Release the gathered buffer; ``state`` says whether a secondary copy remains."""
        assert state in (ShardState.SHARDED, ShardState.SECONDARY)
        self.full.untyped_storage().resize_(0)
        self.state = state
        self.pending_gather = None

    def install_views(self, on_last_use: Callable[["FlatParam"], None] | None = None) -> None:
        """Point every use of every parameter at its view of ``full``.

        ``on_last_use(self)`` is called in backward once autograd has every parameter
        gradient of every forward since :meth:`forget_uses`, just before it concatenates
        them into one full-size gradient: nothing needs the gathered values any more, so
        they can be freed before that concatenation allocates."""
        source = self.full if torch.is_grad_enabled() else self.full.detach()
        # One split node instead of a slice per parameter: its backward writes all
        # parameter gradients into one full-size buffer with a single concatenation.
        pieces = torch.split(source, self._split_sizes)[1::2]
        if on_last_use is not None and source.requires_grad and pieces:
            self.uses_in_graph += 1
            pieces[0].grad_fn.register_prehook(functools.partial(self._use_differentiated, on_last_use))
        for slot, piece in zip(self.slots, pieces):
            view = piece.view(slot.shape)
            for use in slot.uses:
                if use.attr in use.module._parameters:
                    replaced = use.module._parameters[use.attr]
                    raise ValueError(
                        f"parameter {slot.names[0]} was replaced after wrapping (now shape "
                        f"{tuple(replaced.shape) if replaced is not None else None}, wrapped with "
                        f"{tuple(slot.shape)}); build the model completely before ShardedModel, or wrap it again"
                    )
                setattr(use.module, use.attr, view)

    def drop_cleared_grad(self) -> None:
        """A piece whose grad was set to None (an optimizer over ``model.parameters()``
        zeroing them) means the accumulated gradient was cleared: release the master's grad,
        whose storage the pieces' views kept alive, so it does not outlive the step."""
        if self.master.grad is not None and any(piece.parameter.grad is None for piece in self.local_pieces):
            self.clear_grad()

    def _use_differentiated(self, on_last_use, grad_outputs) -> None:
        self.uses_in_graph -= 1
        if self.uses_in_graph == 0:  # below zero: a graph from before forget_uses, leave it
            on_last_use(self)

    def forget_uses(self) -> None:
        """Backward ended: graphs never differentiated (a forward without backward) no longer count."""
        self.uses_in_graph = 0

    def accumulate_grad(self, shard_grad: torch.Tensor) -> None:
        """Add a reduced gradient shard ([shard_numel] fp32) into the master's grad; the
        local pieces' grads are views of it (see :meth:`drop_cleared_grad`)."""
        self.drop_cleared_grad()
        if self.master.grad is None:
            self.master.grad = shard_grad
        else:
            self.master.grad.add_(shard_grad)
        for piece in self.local_pieces:
            piece.parameter.grad = self.master.grad[piece.begin : piece.begin + piece.parameter.numel()]

    def clear_grad(self) -> None:
        self.master.grad = None
        for piece in self.local_pieces:
            piece.parameter.grad = None

    def full_values(self, gathered_fp32: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a gathered fp32 buffer into ``{name: tensor}`` for every parameter name."""
        result = {}
        for slot in self.slots:
            value = gathered_fp32[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for name in slot.names:
                result[name] = value
        return result

