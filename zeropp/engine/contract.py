"""The PyTorch contract of a wrapped model, as FSDP2 and DDP users expect it: parameters
for a plain torch optimizer, state dicts, gradient clipping over the shards.

``ShardedModel`` does not forward attribute lookups to the wrapped module (its
attributes are under ``model.module``), and ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` / ``get_optimizer_state_dict`` stop at that lookup: they map
parameters to names through FSDP's and DTensor's layouts, and would store this rank's
optimizer pieces as if every rank held the same values. The error they raise says what
to call instead (docs/design.md, "State dicts").
"""

from __future__ import annotations

import torch
from torch import nn

from ..sharding import FlatParam
from . import state_dict

CHECKPOINT_GUIDE = (
    "torch.distributed.checkpoint.state_dict's get_model_state_dict / get_optimizer_state_dict (and their set_ "
    "counterparts) do not know zeropp's flat shards: use model.state_dict() (DCP-ready ShardedTensors) and "
    "zeropp.checkpoint.optimizer_state_dict(model, optimizer), or save and load "
    "{'train': zeropp.checkpoint.DistributedState(model, optimizer)} with torch.distributed.checkpoint"
)


class TorchContract:
    """Methods of ``ShardedModel`` (mixed in before ``nn.Module``) that give its shards
    the shape of the ``nn.Module`` API."""

    def __getattr__(self, name: str):
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("module")
            if wrapped is None or not hasattr(wrapped, name):
                raise
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}': the wrapped module's is "
                             f"model.module.{name}. (If this came from {CHECKPOINT_GUIDE}.)")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's fp32 master pieces under the original names: 1-D, [elements held
        here] (empty where this rank holds none of a parameter), sharing the master shards'
        storage, so ``torch.optim.AdamW(model.parameters())`` trains the model."""
        for flat in self.flat_params():
            for piece in flat.local_pieces:
                names = piece.slot.names if not remove_duplicate else piece.slot.names[:1]
                for name in names:
                    yield prefix + name, piece.parameter

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Sharded: ``ShardedTensor`` s of the flattened parameters, this rank's piece local
        (see :mod:`zeropp.engine.state_dict`); ``torch.distributed.checkpoint`` saves and
        loads it at any world size. :meth:`full_state_dict` gives whole tensors."""
        state = state_dict.sharded_state_dict(self, prefix)
        if destination is not None:
            destination.update(state)
            return destination
        return state

    def load_state_dict(self, state: dict, strict: bool = True, assign: bool = False):
        """Sharded (this layout, as ``torch.distributed.checkpoint.load`` fills it) or full
        (whole tensors, original shapes) state; refreshes every derived copy."""
        return state_dict.load_state_dict(self, state, strict)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective: every parameter and buffer whole, fp32, on CPU; on rank 0 only (empty
        elsewhere) with ``rank0_only``."""
        return state_dict.full_state_dict(self, rank0_only)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Collective. Scale the sharded gradients so their global L2 norm is at most
        ``max_norm``; return the norm before clipping (tied weights counted once)."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}")
        grads = [p.grad for p in self.master_parameters() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=self.topology.device)
        for grad in grads:
            total += grad.double().pow(2).sum()
        self._comm.all_reduce_sum(total, self._world, "grad_norm")
        norm = total.sqrt().float()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
        return norm

    @torch.no_grad()
    def gather_master(self, flat: FlatParam, phase: str) -> torch.Tensor:
        """Collective: every rank's fp32 master shard of ``flat``, [padded_numel]."""
        gathered = torch.empty(flat.padded_numel, dtype=torch.float32, device=flat.master.device)
        work = self._comm.all_gather(gathered, flat.master.detach(), self._world, phase, flat.name)
        if work is not None:
            work.wait()
        return gathered

