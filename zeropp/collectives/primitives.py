"""All-gather and reduce-scatter as the engine uses them, with byte accounting.

Reduce-scatter is built from ``all_to_all_single`` plus a local fp32 sum: gloo's
``reduce_scatter_tensor`` is an all-reduce in disguise (about twice the bytes), and
``ReduceOp.AVG`` has been reported to sum on gloo, so we divide by the group size ourselves
(DESIGN.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..accounting import CollectiveRecord, CommLog
from ..topology import Group


@dataclass
class PendingReduceScatter:
    """An all-to-all in flight; :meth:`wait` returns this rank's averaged shard in fp32."""

    work: object | None
    received: torch.Tensor  # [group_size * shard_numel], the chunks every member sent us
    group_size: int

    def progress(self) -> bool:
        """A single all-to-all: nothing is left to launch."""
        return True

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        chunks = self.received.view(self.group_size, -1)
        return chunks.sum(dim=0, dtype=torch.float32).div_(self.group_size)


class Communicator:
    """Issues collectives on a group and records their bytes in ``comm_log``."""

    def __init__(self, comm_log: CommLog) -> None:
        self.comm_log = comm_log

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, group: Group, phase: str, async_op: bool
    ):
        """``output`` [group.size * n] receives every member's ``shard`` [n] in rank order."""
        assert output.numel() == shard.numel() * group.size, (output.shape, shard.shape)
        self.comm_log.record_exchange(
            "all_gather", group.ranks, phase, shard.numel() * shard.element_size()
        )
        if group.size == 1:
            output.copy_(shard)
            return None
        return dist.all_gather_single(output, shard, group=group.handle, async_op=async_op)

    def reduce_scatter_mean(
        self, flat: torch.Tensor, group: Group, phase: str, async_op: bool
    ) -> PendingReduceScatter:
        """Start averaging ``flat`` [group.size * n] over the group; member ``i`` ends with
        the mean of chunk ``i``."""
        assert flat.numel() % group.size == 0
        chunk_bytes = flat.numel() // group.size * flat.element_size()
        self.comm_log.record_exchange("reduce_scatter", group.ranks, phase, chunk_bytes)
        if group.size == 1:
            return PendingReduceScatter(None, flat, 1)
        received = torch.empty_like(flat)
        work = dist.all_to_all_single(received, flat, group=group.handle, async_op=async_op)
        return PendingReduceScatter(work, received, group.size)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, phase: str, async_op: bool):
        """Equal splits: member ``i`` sends row ``j`` of ``input`` [group.size, ...] to member
        ``j`` and receives member ``j``'s row ``i`` into row ``j`` of ``output``."""
        assert input.shape[0] == group.size and output.shape == input.shape
        chunk_bytes = input[0].numel() * input.element_size()
        self.comm_log.record_exchange("all_to_all", group.ranks, phase, chunk_bytes)
        if group.size == 1:
            output.copy_(input)
            return None
        return dist.all_to_all_single(output, input, group=group.handle, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, group: Group, source_rank: int, phase: str) -> None:
        """Broadcast from ``source_rank`` (a global rank); recorded as received by others."""
        if group.size == 1:
            return
        nbytes = tensor.numel() * tensor.element_size()
        me = self.comm_log.rank
        same = self.comm_log.layout.same_node(me, source_rank)
        received = 0 if me == source_rank else nbytes
        self.comm_log.record(
            CollectiveRecord(
                op="broadcast",
                group="world" if group.size == self.comm_log.layout.world_size else group.name,
                phase=phase,
                sent_intra_node=0,
                sent_inter_node=0,
                received_intra_node=received if same else 0,
                received_inter_node=0 if same else received,
            )
        )
        dist.broadcast(tensor, src=source_rank, group=group.handle)
