"""``state_dict`` and ``load_state_dict`` of a wrapped model, as FSDP2 users expect them.

Sharded (the default): every parameter under its original name as a ``ShardedTensor`` of
the parameter flattened to 1-D, [numel], whose local shard is this rank's piece (a view of
the fp32 master, so ``torch.distributed.checkpoint`` loads straight into it, resharding
from any world size). The values answer what code inspecting a state dict asks of a
tensor: ``numel()`` and ``shape`` of the whole (flattened) parameter, ``dtype``, and
``device`` where this rank's shard lives (see :class:`FlatShardedTensor`). Buffers are whole, plain tensors. Full (on request): plain fp32
tensors in the original shapes, on CPU, on rank 0 only or on every rank.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from ..sharding import FlatParam
from ..sharding.flat_param import LocalPiece


class FlatShardedTensor(ShardedTensor):
    """A ``ShardedTensor`` of a flattened parameter that answers ``numel()`` (the plain
    class raises: torch routes it to a sharded op nobody registered) and ``device`` (the
    plain class reports the CPU wrapper's, not the shard's).

    Not a ``DTensor``: DTensor shards a dimension in even chunks, while a rank's piece of a
    parameter is whatever range of it falls in the rank's 1/W of a flat buffer of several
    parameters (docs/design.md, "State dicts").
    """

    _shard_device: torch.device

    def numel(self) -> int:
        return self.metadata().size.numel()

    @property
    def device(self) -> torch.device:
        return self._shard_device


class IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def sharded_tensor(model, flat: FlatParam, piece: LocalPiece, local: torch.Tensor) -> ShardedTensor:
    """``local`` (this rank's [numel of piece] values of one parameter, e.g. the piece itself
    or an optimizer state of it) as a ShardedTensor of the whole flattened parameter."""
    topology = model.topology
    slot, shards, local_shards = piece.slot, [], []
    for rank in range(topology.world_size):
        start = rank * flat.shard_numel
        first = max(start, slot.offset) - slot.offset
        last = min(start + flat.shard_numel, slot.offset + slot.numel) - slot.offset
        if first >= last:
            continue
        metadata = ShardMetadata([first], [last - first], placement(topology, rank))
        shards.append(metadata)
        if rank == topology.rank:
            local_shards.append(Shard(local, metadata))
    properties = TensorProperties(dtype=local.dtype)
    global_metadata = ShardedTensorMetadata(shards, torch.Size([slot.numel]), properties)
    with warnings.catch_warnings():  # torch recommends DTensor, whose even chunks cannot describe flat shards
        warnings.simplefilter("ignore", FutureWarning)
        value = ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, global_metadata, process_group=topology.group("world").handle)
    # torch's constructor names its class outright; the subclass adds no tensor state
    value.__class__ = FlatShardedTensor
    value._shard_device = local.device
    return value


def placement(topology, rank: int) -> str:
    """Where ``rank`` holds its shards, as ``ShardMetadata`` names it: the device that rank
    reported (four emulated nodes' ranks may share one GPU), never one derived from the layout."""
    return f"rank:{rank}/{topology.device_of(rank)}"


def sharded_state_dict(model, prefix: str = "") -> dict:
    state = {}
    for flat in model.flat_params():
        for piece in flat.local_pieces:
            value = sharded_tensor(model, flat, piece, piece.parameter.detach())
            for name in piece.slot.names:
                state[prefix + name] = value
    state.update(_buffers(model, prefix))
    return state


def _buffers(model, prefix: str) -> dict[str, torch.Tensor]:
    """Persistent buffers, whole, as ``nn.Module.state_dict`` lists them."""
    names = {}
    for module_name, module in model.module.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is not None and attr not in module._non_persistent_buffers_set:
                names[prefix + (f"{module_name}.{attr}" if module_name else attr)] = buffer.detach()
    return names


@torch.no_grad()
def full_state_dict(model, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Collective. Whole fp32 parameters and buffers on CPU (empty on ranks other than 0
    when ``rank0_only``); peak memory one flat buffer beyond the result."""
    holds = not rank0_only or model.topology.rank == 0
    state = {}
    for flat in model.flat_params():
        gathered = model.gather_master(flat, "state_dict")
        if holds:
            state.update({name: value.cpu().clone() for name, value in flat.full_values(gathered).items()})
    if holds:
        state.update({name: buffer.cpu().clone() for name, buffer in _buffers(model, "").items()})
    return state


@torch.no_grad()
def load_state_dict(model, state: dict, strict: bool) -> IncompatibleKeys:
    """Loads a sharded state dict (this layout's ShardedTensors, e.g. filled by
    ``torch.distributed.checkpoint.load``) or a full one (plain tensors, original shapes)."""
    used, missing = set(), []
    for flat in model.flat_params():
        for piece in flat.local_pieces:
            name = next((name for name in piece.slot.names if name in state), None)
            if name is None:
                missing.append(piece.slot.names[0])
                continue
            used.update(n for n in piece.slot.names if n in state)
            piece.parameter.copy_(_local_values(state[name], name, piece))
    for name, buffer in _buffers(model, "").items():
        if name in state:
            used.add(name)
            buffer.copy_(state[name])
        else:
            missing.append(name)
    unexpected = sorted(set(state) - used)
    if strict and (missing or unexpected):
        raise ValueError(f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    model.on_weights_changed(include_frozen=True)
    return IncompatibleKeys(missing, unexpected)


def _local_values(value, name: str, piece: LocalPiece) -> torch.Tensor:
    numel = piece.parameter.numel()
    if isinstance(value, ShardedTensor):
        local = [shard for shard in value.local_shards() if shard.metadata.shard_offsets[0] == piece.first]
        if numel and (len(local) != 1 or local[0].tensor.numel() != numel):
            raise ValueError(f"{name}: the ShardedTensor's local shard does not match this rank's piece "
                             f"(elements {piece.first}..{piece.first + numel}); load it through "
                             "torch.distributed.checkpoint into this model's own state_dict()")
        return local[0].tensor if numel else piece.parameter
    if value.numel() != piece.slot.numel:
        raise ValueError(f"{name} has shape {tuple(value.shape)}, the model's parameter {tuple(piece.slot.shape)}")
    return value.reshape(-1)[piece.first : piece.first + numel]
