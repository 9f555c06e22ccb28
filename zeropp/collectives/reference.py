"""Slow, obviously-correct references for the engine's collectives (used by tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..topology import Group


def reference_all_gather(shard: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every member's shard via the list-based all_gather."""
    pieces = [torch.empty_like(shard) for _ in range(group.size)]
    dist.all_gather(pieces, shard.contiguous(), group=group.handle)
    return torch.cat(pieces)


def reference_reduce_scatter_mean(flat: torch.Tensor, group: Group, member_index: int) -> torch.Tensor:
    """All-reduce the whole buffer in fp64, divide by the group size, keep our chunk."""
    total = flat.to(torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group.handle)
    chunk = total.numel() // group.size
    return (total[member_index * chunk : (member_index + 1) * chunk] / group.size).float()
