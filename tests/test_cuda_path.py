"""CUDA-only mistakes the CPU run cannot show, caught without a GPU."""

import time

import torch

from zeropp import Layout, Topology
from zeropp.collectives.failures import CollectiveCall, TrackedWork
from zeropp.collectives.wait_clock import WaitClock
from zeropp.engine.state_dict import placement


def test_shard_placement_is_the_device_each_rank_reported():
    # Four ranks emulating two nodes of two on one GPU: all on cuda:0, whatever the layout says.
    topology = Topology(Layout(4, 2), rank=1, groups={}, device="cuda:0", device_map=[torch.device("cuda:0")] * 4)
    assert [placement(topology, rank) for rank in range(4)] == ["rank:0/cuda:0", "rank:1/cuda:0", "rank:2/cuda:0",
                                                                "rank:3/cuda:0"]
    on_cpu = Topology(Layout(4, 2), rank=1, groups={})
    assert placement(on_cpu, 3) == "rank:3/cpu"


class StreamTimeline:
    """Stands in for the GPU: events read a stream clock that a collective's wait advances
    without blocking the host, as NCCL's work.wait() does."""

    def __init__(self) -> None:
        self.stream_seconds = 0.0

    def event_class(self):
        timeline = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = timeline.stream_seconds

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000.0

        return Event


class NcclLikeWork:
    def __init__(self, timeline: StreamTimeline, stall_seconds: float) -> None:
        self.timeline, self.stall_seconds = timeline, stall_seconds

    def wait(self):  # returns at once; the compute stream stalls
        self.timeline.stream_seconds += self.stall_seconds
        return True

    def is_completed(self):
        return True


def test_waits_on_cuda_are_timed_on_the_stream_not_the_host(monkeypatch):
    timeline = StreamTimeline()
    monkeypatch.setattr(torch.cuda, "Event", timeline.event_class())
    clock = WaitClock()
    call = CollectiveCall("all_gather", "world", "forward_gather", "unit", 1024, "bfloat16")
    started = time.perf_counter()
    for _ in range(3):
        TrackedWork(NcclLikeWork(timeline, 0.25), call, 0, 4, clock, torch.device("cuda:0")).wait()
    assert time.perf_counter() - started < 0.1  # the host never blocked
    assert abs(clock.take() - 0.75) < 1e-9
    assert clock.take() == 0.0
    assert abs(clock.total - 0.75) < 1e-9


def test_waits_on_the_cpu_are_host_time():
    class BlockingWork:
        def wait(self):
            time.sleep(0.05)

    clock = WaitClock()
    call = CollectiveCall("all_gather", "world", "forward_gather", "unit", 1024, "float32")
    TrackedWork(BlockingWork(), call, 0, 4, clock, torch.device("cpu")).wait()
    assert 0.04 < clock.take() < 1.0
