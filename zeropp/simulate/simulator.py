"""Replays a recorded :class:`~zeropp.simulate.schedule.Schedule` on a :class:`Hardware`.

Two kinds of stream, as on a GPU: one compute stream, and one communication stream per
process group (NCCL gives each communicator its own). Events are taken in the host order
the engine issued them:

- ``Compute``: the compute stream runs the unit's products, 2 (forward, recompute) or 4
  (backward) x parameters x tokens FLOPs, slowed while any collective is in flight.
- ``Issue``: the collective is ready when the compute issued before it is done (its input
  comes from there) and, if the ranks have computed since they were last lined up, the
  arrival skew later (the slowest rank's compute); it starts when its group's stream and,
  if it crosses nodes, the node's adapters are free. A quantized payload (int8/uint8)
  first costs its quantize kernel on the compute stream.
- ``Wait``: the compute stream stalls until the collective is done (a stall lines the
  ranks up), copies what this rank received where the host moves the bytes (gloo), then
  dequantizes a quantized payload.

A collective's time is its latency (NCCL's model: a base plus one step per ring hop) plus
the longer of its two hops: the bytes the node's adapters carry in, all ranks of the node
together (every rank of a node issues its own copy of a collective at the same time), at
the adapters' rate, and the bytes one rank receives from its own node at the intra-node
rate. Bytes are counted as the accounting counts them (``zeropp.accounting.log``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import traffic
from ..topology import Layout
from ..traffic import Traffic
from .hardware import Hardware
from .schedule import Collective, Compute, Issue, Schedule, Wait

FLOPS_PER_PARAMETER_TOKEN = {"forward": 2, "recompute": 2, "backward": 4}
QUANTIZED_DTYPES = ("int8", "uint8")


@dataclass(frozen=True)
class CollectiveTime:
    latency_s: float
    inter_node_s: float  # the node's adapters busy
    intra_node_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + max(self.inter_node_s, self.intra_node_s)


@dataclass
class StepTime:
    """One simulated step; the busy times say what bounds it."""

    step_s: float = 0.0
    compute_s: float = 0.0  # the products at full speed
    kernels_s: float = 0.0  # quantize/dequantize and the optimizer
    inter_node_s: float = 0.0  # the node's adapters busy
    intra_node_s: float = 0.0
    latency_s: float = 0.0
    stalled_s: float = 0.0  # compute stream waiting for collectives
    host_copy_s: float = 0.0  # compute stream copying received bytes (gloo's TCP)
    flops: float = 0.0  # per rank, recomputation included
    # The compute stream's clock where the host reaches each event, in the schedule's order:
    # a compute as it starts, an issue once launched, a wait once the stream resumes (beside
    # a recorded event's ``at_s``, where the replay parts from the step it replays).
    event_clock_s: list[float] = field(default_factory=list)

    @property
    def bottleneck(self) -> str:
        busy = {"compute": self.compute_s, "inter-node link": self.inter_node_s,
                "intra-node link": self.intra_node_s, "kernels": self.kernels_s, "latency": self.latency_s,
                "host copies": self.host_copy_s}
        return max(busy, key=busy.get)


def collective_time(collective: Collective, layout: Layout, rank: int, hardware: Hardware) -> CollectiveTime:
    """The collective as ``rank``'s node runs it: every rank of the node in its own group."""
    group = collective.group_ranks
    size = len(group)
    if size == 1:
        return CollectiveTime(0.0, 0.0, 0.0)
    node = layout.node_of(rank)
    on_node = [member for member in group if layout.node_of(member) == node]
    inter = intra = 0
    for member in on_node:
        received = _received(collective, layout, member)
        inter += received.inter_node
        intra = max(intra, received.intra_node)
    copies = layout.ranks_per_node // len(on_node)  # this collective's copies on the node, one per rank
    inter = inter * copies
    nodes = len({layout.node_of(member) for member in group})
    steps = size - 1
    latency = (hardware.base_latency_s + (steps - (nodes - 1)) * hardware.intra_node_step_latency_s
               + (nodes - 1) * hardware.inter_node_step_latency_s)
    return CollectiveTime(latency, inter / hardware.inter_node_rate(copies),
                          intra / (hardware.intra_node_bytes_per_s * hardware.link_efficiency))


def host_receive_seconds(collective: Collective, layout: Layout, rank: int, hardware: Hardware) -> float:
    """Host time ``rank`` spends copying what it receives in ``collective`` (0 on GPUs)."""
    if len(collective.group_ranks) == 1:
        return 0.0
    received = _received(collective, layout, rank)
    seconds = 0.0
    for nbytes, rate in ((received.intra_node, hardware.host_receive_intra_node_bytes_per_s),
                         (received.inter_node, hardware.host_receive_inter_node_bytes_per_s)):
        if rate > 0:
            seconds += nbytes / rate
    return seconds


def _received(collective: Collective, layout: Layout, member: int) -> Traffic:
    """What ``member`` receives, as the accounting counts it."""
    count = traffic.ring if collective.algorithm == "ring" else traffic.exchange
    return count(layout, member, collective.group_ranks, collective.chunk_bytes)


@dataclass
class _Streams:
    """The compute stream's clock, each group's stream, the node's adapters, the
    intervals in which some collective is in flight (they slow compute), and whether the
    ranks are lined up (none has computed since a collective held them all)."""

    hardware: Hardware
    compute_clock: float = 0.0
    ranks_aligned: bool = True
    group_free: dict[tuple[int, ...], float] = field(default_factory=dict)
    adapters_free: float = 0.0
    in_flight: list[tuple[float, float]] = field(default_factory=list)

    def run_compute(self, seconds: float) -> None:
        """Advance the compute clock by ``seconds`` of work at full speed, slower while
        collectives are in flight."""
        slow_rate = 1.0 - self.hardware.slowdown_during_communication
        self.in_flight = [(start, end) for start, end in self.in_flight if end > self.compute_clock]
        clock, left = self.compute_clock, seconds
        for start, end in _merged(self.in_flight):
            if left <= 0 or end <= clock:
                continue
            if start > clock:  # a gap at full speed first
                gap = min(start - clock, left)
                clock, left = clock + gap, left - gap
                if left <= 0:
                    break
            overlap = min(end - clock, left / slow_rate)
            clock, left = clock + overlap, left - overlap * slow_rate
        self.compute_clock = clock + max(left, 0.0)

    def start_collective(self, collective: Collective, time: CollectiveTime) -> float:
        """Place a collective issued now; returns when it is done."""
        ready = self.compute_clock + (0.0 if self.ranks_aligned else self.hardware.arrival_skew_s)
        start = max(ready, self.group_free.get(collective.group_ranks, 0.0))
        if time.inter_node_s > 0:
            start = max(start, self.adapters_free)
            self.adapters_free = start + time.latency_s + time.inter_node_s
        end = start + time.seconds
        self.group_free[collective.group_ranks] = end
        if end > start:
            self.in_flight.append((start, end))
        return end

    def wait(self, finished: float) -> float:
        """The compute stream waits for a collective done at ``finished``; returns the stall."""
        stalled = max(0.0, finished - self.compute_clock)
        if stalled > 0:  # every rank left the collective together
            self.ranks_aligned = True
        self.compute_clock += stalled
        return stalled


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def simulate(schedule: Schedule, hardware: Hardware) -> StepTime:
    """The step ``schedule`` records, on ``hardware``."""
    layout = Layout(schedule.world_size, schedule.ranks_per_node)
    streams = _Streams(hardware)
    result = StepTime()
    done: dict[int, float] = {}
    times = [collective_time(collective, layout, schedule.rank, hardware) for collective in schedule.collectives]
    for event in schedule.events:
        if isinstance(event, Compute):
            result.event_clock_s.append(streams.compute_clock)
            flops = FLOPS_PER_PARAMETER_TOKEN[event.kind] * event.parameters * schedule.tokens_per_rank
            seconds = hardware.matmul_seconds(flops, schedule.tokens_per_rank, event.parameters)
            result.flops += flops
            result.compute_s += seconds
            streams.run_compute(seconds)
            streams.ranks_aligned = False
        elif isinstance(event, Issue):
            collective = schedule.collectives[event.collective_id]
            if collective.dtype in QUANTIZED_DTYPES:  # quantize this rank's chunk first
                _kernel(streams, result, 3 * collective.chunk_bytes)
            time = times[event.collective_id]
            done[event.collective_id] = streams.start_collective(collective, time)
            result.event_clock_s.append(streams.compute_clock)
            result.inter_node_s += time.inter_node_s
            result.intra_node_s += time.intra_node_s
            result.latency_s += time.latency_s
        elif isinstance(event, Wait):
            result.stalled_s += streams.wait(done[event.collective_id])
            collective = schedule.collectives[event.collective_id]
            copy_s = host_receive_seconds(collective, layout, schedule.rank, hardware)
            result.host_copy_s += copy_s
            streams.run_compute(copy_s)
            result.event_clock_s.append(streams.compute_clock)
            if collective.dtype in QUANTIZED_DTYPES:  # dequantize every member's chunk
                _kernel(streams, result, 3 * collective.chunk_bytes * len(collective.group_ranks))
    end = max([streams.compute_clock, *done.values()])
    optimizer_s = schedule.optimizer_parameters * hardware.optimizer_bytes_per_parameter / hardware.kernel_bytes_per_s
    result.kernels_s += optimizer_s
    result.step_s = end + optimizer_s
    return result


def _kernel(streams: _Streams, result: StepTime, nbytes: int) -> None:
    """A memory-bound kernel on the compute stream: int8/int4 values in, fp16/fp32 out."""
    seconds = nbytes / streams.hardware.kernel_bytes_per_s
    result.kernels_s += seconds
    streams.run_compute(seconds)
