"""Auto mode's step model: the step simulator (docs/design.md section 12) replaying a
candidate's own recorded step on the links auto mode probed.

A measured candidate is predicted at new links from what it did, not from a description of
it: its last measured step's schedule (the engine records it while auto mode runs) is
replayed twice, over the links it was measured on and over the new ones, with its units'
compute taking the compute time measured (the step less the time blocked in collectives),
shared in proportion to their FLOPs. The prediction is the measured step plus the
difference, so what the replay does not explain (host time blocked on shared cores,
Python between collectives) is kept, as measured.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..simulate.hardware import Hardware
from ..simulate.schedule import Compute, Schedule
from ..simulate.simulator import FLOPS_PER_PARAMETER_TOKEN, simulate
from .step_model import LinkSpeeds


def probed_hardware(links: LinkSpeeds, ranks_per_node: int, flops_per_s: float) -> Hardware:
    """The hardware a replay runs on: the probed links, compute at ``flops_per_s``, and
    nothing else (kernels, the optimizer and everything on the host are in the measured
    compute time)."""
    return Hardware(
        name="auto mode's probed links", sustained_flops=flops_per_s, slowdown_during_communication=0.0,
        processors=0, tile_m=1, tile_n=1,
        # The probe gives what a node's ranks receive from each other together; the
        # simulator's intra-node link is one rank's.
        intra_node_bytes_per_s=links.intra_node_bytes_per_s / max(1, ranks_per_node),
        network_adapters_per_node=1, adapter_bytes_per_s=links.inter_node_bytes_per_s, link_efficiency=1.0,
        parallel_flows_adapter_bytes_per_s=0.0,
        base_latency_s=0.0, intra_node_step_latency_s=links.latency_s, inter_node_step_latency_s=links.latency_s,
        arrival_skew_s=0.0, host_receive_intra_node_bytes_per_s=0.0, host_receive_inter_node_bytes_per_s=0.0,
        kernel_bytes_per_s=math.inf, optimizer_bytes_per_parameter=0,
        sources={"all": "auto mode's link probe and the candidate's measured compute time"})


def replayed_step_s(schedule: Schedule, compute_s: float, links: LinkSpeeds) -> float:
    """Seconds of the recorded step over ``links`` when its units' compute takes
    ``compute_s`` in all."""
    relative = replace(schedule, tokens_per_rank=1, optimizer_parameters=0)  # compute in proportion only
    flops = sum(FLOPS_PER_PARAMETER_TOKEN[event.kind] * event.parameters
                for event in relative.events if isinstance(event, Compute))
    flops_per_s = flops / compute_s if flops > 0 and compute_s > 0 else math.inf
    return simulate(relative, probed_hardware(links, schedule.ranks_per_node, flops_per_s)).step_s


def predicted_step_s(step_s: float, compute_s: float, schedule: Schedule, measured_on: LinkSpeeds,
                     links: LinkSpeeds) -> float:
    """A step measured as ``step_s`` over ``measured_on``, predicted over ``links``: no
    shorter than its compute."""
    change = replayed_step_s(schedule, compute_s, links) - replayed_step_s(schedule, compute_s, measured_on)
    return max(step_s + change, compute_s)
