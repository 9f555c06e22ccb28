"""Model and optimizer state for ``torch.distributed.checkpoint`` (DCP), resharding to any
world size on load::

    state = {"train": DistributedState(model, optimizer)}
    torch.distributed.checkpoint.save(state, checkpoint_id=folder)
    torch.distributed.checkpoint.load(state, checkpoint_id=folder)  # at any world size

Parameters and every per-element optimizer state (Adam's moments, SGD's momentum) are
keyed by the original parameter names as ``ShardedTensor`` s of the flattened parameter
(see :mod:`zeropp.engine.state_dict`); per-parameter scalars (Adam's step) are plain tensors.
The optimizer may step the master shards (``ShardedOptimizer``) or the pieces from
``model.parameters()``; either way its state is written in place by the load.
"""

from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..engine.state_dict import sharded_tensor
from ..sharding import FlatParam
from ..sharding.flat_param import LocalPiece


class DistributedState(Stateful):
    def __init__(self, model, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = optimizer_state_dict(self.model, self.optimizer)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # ShardedOptimizer wraps a torch optimizer


def _locate(model) -> dict[int, tuple[FlatParam, list[LocalPiece]]]:
    """id(optimizer parameter) -> (flat, the pieces that parameter covers)."""
    where = {}
    for flat in model.flat_params():
        where[id(flat.master)] = (flat, flat.local_pieces)
        for piece in flat.local_pieces:
            where[id(piece.parameter)] = (flat, [piece])
    return where


def optimizer_state_dict(model, optimizer: torch.optim.Optimizer) -> dict:
    inner = _inner(optimizer)
    _initialize_state(inner)
    where = _locate(model)
    state, groups = {}, {}
    for index, group in enumerate(inner.param_groups):
        for param in group["params"]:
            if id(param) not in where:
                raise ValueError("the optimizer steps a parameter that is not this model's: build it over "
                                 "model.parameters() or through ShardedOptimizer")
            flat, pieces = where[id(param)]
            whole = param is flat.master
            for piece in pieces:
                state[piece.slot.names[0]] = {key: _piece_value(model, flat, piece, value, whole)
                                              for key, value in inner.state[param].items()}
        groups[str(index)] = {key: _plain(value) for key, value in group.items() if key != "params"}
    # Hyperparameters as one JSON string: DCP stores it whole and hands it back whole.
    return {"state": state, "param_groups": json.dumps(groups)}


def _plain(value):
    """A hyperparameter as JSON can hold it (learning rates may be tensors)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    return list(value) if isinstance(value, tuple) else value


def _piece_value(model, flat: FlatParam, piece: LocalPiece, value, whole: bool):
    numel = piece.parameter.numel()
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == (flat.shard_numel if whole else numel):
        local = value[piece.begin : piece.begin + numel] if whole else value
        return sharded_tensor(model, flat, piece, local)
    return value.clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def load_optimizer_state_dict(model, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Copies ``saved`` (as ``optimizer_state_dict`` made it, DCP-filled) into the optimizer."""
    inner = _inner(optimizer)
    _initialize_state(inner)
    where = _locate(model)
    groups = json.loads(saved["param_groups"])
    if len(groups) != len(inner.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} parameter groups, the optimizer {len(inner.param_groups)}")
    for index, group in enumerate(inner.param_groups):
        for key, value in groups[str(index)].items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(current, tuple) else value
        for param in group["params"]:
            flat, pieces = where[id(param)]
            whole = param is flat.master
            for key, value in inner.state[param].items():
                for piece in pieces:
                    stored = saved["state"][piece.slot.names[0]][key]
                    _restore(value, stored, piece, whole, inner.state[param], key)


def _restore(value, stored, piece: LocalPiece, whole: bool, state: dict, key: str) -> None:
    if not isinstance(value, torch.Tensor):
        state[key] = stored
        return
    if hasattr(stored, "local_shards"):
        numel = piece.parameter.numel()
        target = value[piece.begin : piece.begin + numel] if whole else value
        for shard in stored.local_shards():
            target.copy_(shard.tensor)
        return
    value.copy_(stored)


@torch.no_grad()
def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (DCP loads into existing tensors): one step with zero
    gradients at learning rate 0, which changes no parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    saved = [(p, p.grad) for p in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for p, grad in saved:
        p.grad = grad
