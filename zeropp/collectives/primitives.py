"""All-gather, reduce-scatter and all-to-all as the engine uses them, with byte accounting
and failure reporting.

Reduce-scatter is built from ``all_to_all_single`` plus a local fp32 sum: gloo's
``reduce_scatter_tensor`` is an all-reduce in disguise (about twice the bytes), and
``ReduceOp.AVG`` has been reported to sum on gloo, so we divide by the group size ourselves
(docs/design.md section 5.1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..accounting import CollectiveRecord, CommLog
from ..simulate.schedule import Collective, ScheduleRecorder
from ..topology import Group
from .failures import CollectiveCall, TrackedWork, check_same_call
from .wait_clock import WaitClock


@dataclass
class PendingReduceScatter:
    """An all-to-all in flight; :meth:`wait` returns this rank's averaged shard in fp32."""

    work: TrackedWork | None
    received: torch.Tensor  # [group_size * shard_numel], the chunks every member sent us
    group_size: int  # chunks in ``received`` to sum locally (1 after a real reduce-scatter)
    divisor: int | None = None  # what to divide the sum by; default group_size

    def progress(self) -> bool:
        """A single all-to-all: nothing is left to launch."""
        return True

    def release(self) -> bool:
        """One hop only: nothing to leave in flight on its own."""
        return False

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        chunks = self.received.view(self.group_size, -1)
        return chunks.sum(dim=0, dtype=torch.float32).div_(self.divisor or self.group_size)


class Communicator:
    """Issues collectives on a group, records their bytes in ``comm_log``, and in debug mode
    checks that every member issues the same call."""

    def __init__(self, comm_log: CommLog, check_order: bool = False, device: torch.device | str | None = None) -> None:
        self.comm_log = comm_log
        self.check_order = check_order
        self.device = None if device is None else torch.device(device)  # every tensor must be there
        self._clock = WaitClock()
        self.schedule: ScheduleRecorder | None = None  # set while a step's schedule is recorded

    def take_wait_seconds(self) -> float:
        """Seconds computation waited for collectives since the last call: the communication
        it did not hide (host time on the CPU, compute-stream stalls on CUDA)."""
        return self._clock.take()

    @property
    def total_wait_seconds(self) -> float:
        """Seconds waited for collectives since construction (never reset)."""
        return self._clock.total

    def _launch(self, op: str, group: Group, phase: str, label: str, tensor: torch.Tensor, launch,
                movement: tuple[str, int] = ("exchange", 0)):
        """``movement``: (algorithm, chunk bytes) as the accounting counts them, for the schedule."""
        call = CollectiveCall(op, group.name, phase, label, tensor.numel(), str(tensor.dtype).removeprefix("torch."))
        if self.device is not None and tensor.device != self.device:
            raise ValueError(f"{call.describe()}: the tensor is on {tensor.device}, the topology's device is "
                             f"{self.device}; create it with device=topology.device")
        # Not on a side group: the check blocks, and a side group's collectives start at
        # points that differ between ranks, so a blocking check there would wait on a peer
        # blocked in the main group's check (a deadlock the collectives themselves avoid).
        if self.check_order and not group.launched_on_arrival:
            check_same_call(call, group.handle, group.size, tensor.device)
        work = launch()
        on_wait = None
        if self.schedule is not None:
            algorithm, chunk_bytes = movement
            collective_id = self.schedule.issued(Collective(op, algorithm, tuple(group.ranks), chunk_bytes, phase, call.dtype))
            on_wait = functools.partial(self.schedule.waited, collective_id)
        return TrackedWork(work, call, self.comm_log.rank, self.comm_log.layout.world_size, self._clock, tensor.device,
                           on_wait)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group: Group, phase: str, label: str = ""):
        """Start gathering every member's ``shard`` [n] into ``output`` [group.size * n] in
        rank order; returns a work to ``wait`` on (None for a group of one)."""
        assert output.numel() == shard.numel() * group.size, (output.shape, shard.shape)
        self.comm_log.record_ring("all_gather", group.ranks, phase, shard.numel() * shard.element_size())
        if group.size == 1:
            output.copy_(shard)
            return None
        return self._launch(
            "all_gather", group, phase, label, shard,
            lambda: dist.all_gather_single(output, shard, group=group.handle, async_op=True),
            ("ring", shard.numel() * shard.element_size()),
        )

    def reduce_scatter_mean(self, flat: torch.Tensor, group: Group, phase: str, label: str = "") -> PendingReduceScatter:
        """Start averaging ``flat`` [group.size * n] over the group; member ``i`` ends with
        the mean of chunk ``i``."""
        assert flat.numel() % group.size == 0
        chunk_bytes = flat.numel() // group.size * flat.element_size()
        if group.size == 1:
            self.comm_log.record_exchange("reduce_scatter", group.ranks, phase, chunk_bytes)
            return PendingReduceScatter(None, flat, 1)
        if self.native_reduce_scatter(group, flat.device):
            # NCCL has a real (ring) reduce-scatter; sum, and divide by the size ourselves.
            self.comm_log.record_ring("reduce_scatter", group.ranks, phase, chunk_bytes)
            received = torch.empty(flat.numel() // group.size, dtype=flat.dtype, device=flat.device)
            work = self._launch(
                "reduce_scatter", group, phase, label, flat,
                lambda: dist.reduce_scatter_tensor(received, flat, op=dist.ReduceOp.SUM, group=group.handle, async_op=True),
                ("ring", chunk_bytes),
            )
            return PendingReduceScatter(work, received, 1, divisor=group.size)
        self.comm_log.record_exchange("reduce_scatter", group.ranks, phase, chunk_bytes)
        received = torch.empty_like(flat)
        work = self._launch(
            "reduce_scatter", group, phase, label, flat,
            lambda: dist.all_to_all_single(received, flat, group=group.handle, async_op=True),
            ("exchange", chunk_bytes),
        )
        return PendingReduceScatter(work, received, group.size)

    @staticmethod
    def native_reduce_scatter(group: Group, device: torch.device) -> bool:
        """Whether ``group`` reduce-scatters ``device`` tensors natively (NCCL's ring, with a
        chunk-sized output) rather than by gloo's all-to-all (a full-size receive buffer).
        A dry run's fake group stands for NCCL. A ``cpu:gloo,cuda:nccl`` group names both."""
        if group.size == 1:
            return False
        backend = str(dist.get_backend(group.handle))
        return backend == "fake" or (device.type == "cuda" and "nccl" in backend)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: Group, phase: str, label: str = ""):
        """Equal splits: member ``i`` sends row ``j`` of ``input`` [group.size, ...] to member
        ``j`` and receives member ``j``'s row ``i`` into row ``j`` of ``output``."""
        assert input.shape[0] == group.size and output.shape == input.shape
        self.comm_log.record_exchange("all_to_all", group.ranks, phase, input[0].numel() * input.element_size())
        if group.size == 1:
            output.copy_(input)
            return None
        return self._launch(
            "all_to_all", group, phase, label, input,
            lambda: dist.all_to_all_single(output, input, group=group.handle, async_op=True),
            ("exchange", input[0].numel() * input.element_size()),
        )

    def all_reduce_sum(self, tensor: torch.Tensor, group: Group, phase: str) -> None:
        """Blocking sum of a small tensor (norms, flags), recorded as a ring all-reduce."""
        self._all_reduce(tensor, group, phase, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor, group: Group, phase: str) -> None:
        """Blocking element-wise maximum of a small tensor (timings every rank must agree on)."""
        self._all_reduce(tensor, group, phase, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, group: Group, phase: str, op) -> None:
        self.comm_log.record_exchange("all_reduce", group.ranks, phase, tensor.numel() * tensor.element_size())
        if group.size > 1:
            self._launch(
                "all_reduce", group, phase, "", tensor,
                lambda: dist.all_reduce(tensor, op=op, group=group.handle, async_op=True),
                ("exchange", tensor.numel() * tensor.element_size()),
            ).wait()

    def broadcast(self, tensor: torch.Tensor, group: Group, source_rank: int, phase: str) -> None:
        """Broadcast from ``source_rank`` (a global rank); recorded as received by others."""
        if group.size == 1:
            return
        nbytes = tensor.numel() * tensor.element_size()
        me = self.comm_log.rank
        received = 0 if me == source_rank else nbytes
        same_node = self.comm_log.layout.same_node(me, source_rank)
        self.comm_log.record(
            CollectiveRecord("broadcast", group.name, phase, 0, 0, received if same_node else 0, 0 if same_node else received)
        )
        self._launch(
            "broadcast", group, phase, "", tensor,
            lambda: dist.broadcast(tensor, src=source_rank, group=group.handle, async_op=True),
        ).wait()
