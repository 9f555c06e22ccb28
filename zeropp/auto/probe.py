"""Timed probe collectives that measure the links auto mode plans for.

Every rank of a node gathers at once among its peers on the other nodes, as a training
step's collectives do, so the node's link is shared the way training shares it:

    latency    one-byte all-gather across nodes, best of three
    inter      all-gather of S bytes per rank across nodes: D * (N - 1) * S bytes into a node
               (at the start the fastest of three)
    intra      all-gather of S bytes per rank inside the node: D * (D - 1) * S bytes

Times are the slowest rank's (all ranks then plan from the same figures). Probes are
recorded in the accounting under the phase ``"auto"``, so byte checks against the link
counters still add up.
"""

from __future__ import annotations

import math
import time

import torch

from ..collectives import Communicator
from ..topology import Topology
from .step_model import LinkSpeeds

PHASE = "auto"
PROBE_SECONDS = 0.05  # a probe long enough to dwarf latency and the shaper's burst
SMALLEST_PROBE_BYTES = 256 * 1024  # into one node, all its ranks together
LARGEST_PROBE_BYTES = 8 * 1024 * 1024
START_PROBES = 3  # sized inter-node probes at the start, the fastest kept


class LinkProbe:
    def __init__(self, topology: Topology, communicator: Communicator) -> None:
        self.topology = topology
        self.communicator = communicator
        self.latency_s = 0.0
        self._intra_node_bytes_per_s = math.inf

    @property
    def crosses_nodes(self) -> bool:
        return self.topology.num_nodes > 1

    def measure_all(self) -> LinkSpeeds:
        """Latency, intra-node and inter-node bandwidth (at start; a few probes)."""
        if not self.crosses_nodes:
            return LinkSpeeds(math.inf)
        self.latency_s = min(self._timed_gather("inter_node", 1) for _ in range(3))
        if self.topology.ranks_per_node > 1:
            nodes = self.topology.ranks_per_node
            self._intra_node_bytes_per_s = self._bandwidth("intra_node", nodes * (nodes - 1), LARGEST_PROBE_BYTES)
        first = self.measure_inter_node(math.inf)  # smallest probe, then ones sized by it
        # The fastest of a few: at the job's start single probes came out far under the link
        # (331 Mbit/s on loopback, where another run's found 3,486; 352 on a 1 Gbit/s link,
        # where the probe that re-planned 26 steps later found 927, and the re-plan cost trials).
        sized = [self.measure_inter_node(first.inter_node_bytes_per_s) for _ in range(START_PROBES)]
        return max(sized, key=lambda links: links.inter_node_bytes_per_s)

    def measure_inter_node(self, expected_bytes_per_s: float) -> LinkSpeeds:
        """The inter-node bandwidth now, by a probe of about ``PROBE_SECONDS`` at the
        bandwidth expected (the last one measured)."""
        if not self.crosses_nodes:
            return LinkSpeeds(math.inf)
        target = min(max(expected_bytes_per_s * PROBE_SECONDS, SMALLEST_PROBE_BYTES), LARGEST_PROBE_BYTES)
        inbound_shares = self.topology.ranks_per_node * (self.topology.num_nodes - 1)
        bandwidth = self._bandwidth("inter_node", inbound_shares, target)
        return LinkSpeeds(bandwidth, self._intra_node_bytes_per_s, self.latency_s)

    def _bandwidth(self, group_name: str, inbound_shares: int, target_bytes: float) -> float:
        """Bytes per second into a node when each of its ranks gathers ``target_bytes /
        inbound_shares`` bytes from the ``inbound_shares`` senders it hears from."""
        per_rank = max(1, int(target_bytes // inbound_shares))
        seconds = self._timed_gather(group_name, per_rank)
        group_size = self.topology.group(group_name).size
        steps = group_size - 1
        return inbound_shares * per_rank / max(seconds - steps * self.latency_s, 1e-6)

    def _timed_gather(self, group_name: str, numel: int) -> float:
        """The slowest rank's seconds for an all-gather of ``numel`` bytes per rank."""
        group, device = self.topology.group(group_name), self.topology.device
        shard = torch.zeros(numel, dtype=torch.uint8, device=device)
        output = torch.empty(numel * group.size, dtype=torch.uint8, device=device)
        self._synchronize()
        started = time.perf_counter()
        work = self.communicator.all_gather(output, shard, group, PHASE, "probe")
        if work is not None:
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        self.communicator.all_reduce_max(elapsed, self.topology.group("world"), PHASE)
        return elapsed.item()

    def _synchronize(self) -> None:
        """All ranks start a probe together (a world all-reduce of one value)."""
        flag = torch.zeros(1, device=self.topology.device)
        self.communicator.all_reduce_sum(flag, self.topology.group("world"), PHASE)
