"""Auto mode's planning rule: from the candidates' measured step times and the links, the
next candidate to try or the one to run (docs/design.md section 11). Pure functions of
their arguments, so the rule is tested on given figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..accounting import FlatSummary
from ..config import ZeroConfig
from ..simulate.schedule import Schedule
from ..topology import Layout
from .candidates import scheme
from .step_model import Accumulation, LinkSpeeds, LinkTime, link_time

WORTH_TRYING = 0.97  # try a candidate only if it might be 3% faster than the best so far
# One step of a shared machine moves by 10-20% in a job's first steps (the fixed runs of the
# emulated cluster, against their medians): candidates measured within CLOSE of the best
# are each measured on CONFIRM_SAMPLES steps before one is chosen. Being close, the extra
# steps cost little.
CLOSE = 1.15  # 1.05 chose zero++ over the two-hop gather, 906 ms to 996, where they run 830 and 760
CONFIRM_SAMPLES = 3
# A step's noise there is one-sided and comes in bursts: one step in twenty runs 24% over its
# scheme's median (a few run 7% under it), and the next step is still slow one time in
# three. So every candidate measured on one step within SECOND_LOOK of the best is measured
# on a second step, later, before it is ruled out: at 1 Gbit/s zero++, tried on one step of
# 1,344 ms where it runs 1,100, lost to qwZ's 1,134 and was never measured again.
SECOND_LOOK = 1.25


@dataclass(frozen=True)
class Measurement:
    step_s: float  # median of the measured steps
    compute_s: float  # step less the time blocked in collectives (median)
    epoch: int  # which bandwidth (plan) it was measured under
    samples: int = 1  # measured steps behind the figures
    links: LinkSpeeds | None = None  # the links it was measured on
    schedule: Schedule | None = None  # a measured step as the engine issued it, to replay on other links


@dataclass(frozen=True)
class Workload:
    flats: list[FlatSummary]
    layout: Layout
    config: ZeroConfig  # the user's; candidates override its scheme fields
    accumulation: Accumulation = Accumulation()  # micro-steps per optimizer step, as last run


@dataclass(frozen=True)
class Plan:
    trial: str | None  # a candidate to measure next, or None: run ``choice``
    choice: str | None
    estimates: dict[str, tuple[float, bool | None]]

    @property
    def reason(self) -> str:
        kinds = {True: "measured", False: "predicted", None: "at least"}
        ranked = sorted(self.estimates.items(), key=lambda item: item[1][0])
        return "step times: " + ", ".join(f"{name} {kinds[how]} {seconds * 1e3:,.0f} ms" for name, (seconds, how) in ranked)


def plan_next(choices: dict[str, dict], measured: dict[str, Measurement], epoch: int, work: Workload,
              links: LinkSpeeds, running: str | None = None, close_calls: bool = True,
              predicted: dict[str, float] | None = None) -> Plan:
    """The next candidate to try, or the one to run. A candidate is tried when it might
    beat the best known by more than 3%, the cheapest bound first (ties in the order of
    ``choices``). Then every candidate measured on one step within 25% of the best gets a
    second look, and a close call (the two fastest measured within 15%) measures more
    steps: the running candidate first, then the one on fewest steps. Then the fastest,
    tried until measured on ``CONFIRM_SAMPLES`` steps at this bandwidth, or run.
    ``close_calls=False`` skips second looks and close calls (the steady state).
    ``predicted``: steps at these links of candidates measured on others (:mod:`.replay`)."""
    predicted = predicted or {}
    estimates = {name: estimate(overrides, measured.get(name), epoch, work, links, predicted.get(name))
                 for name, overrides in choices.items()}
    known = {name: seconds for name, (seconds, how) in estimates.items() if how is not None}
    best = min(known.values(), default=math.inf)
    untried = [(seconds, list(choices).index(name), name) for name, (seconds, how) in estimates.items()
               if how is None and seconds < WORTH_TRYING * best]
    if untried:
        return Plan(min(untried)[2], None, estimates)
    # Second looks and close calls wait until every candidate worth trying has been tried:
    # settled earlier, each candidate near the best ran CONFIRM_SAMPLES steps (all seven at 1 Gbit/s).
    unsettled = _unsettled(measured, epoch, best) if close_calls else []
    if running in unsettled:  # it measures on without a warm-up step
        return Plan(running, None, estimates)
    if unsettled:
        return Plan(min(unsettled, key=lambda name: (measured[name].samples, measured[name].step_s)), None,
                    estimates)
    leader = min(known, key=known.get)
    if not _confirmed(measured[leader], epoch):  # predicted, or measured on too few steps
        return Plan(leader, None, estimates)
    return Plan(None, leader, estimates)


def _confirmed(measurement: Measurement, epoch: int) -> bool:
    return measurement.epoch == epoch and measurement.samples >= CONFIRM_SAMPLES


def _unsettled(measured: dict[str, Measurement], epoch: int, best: float) -> list[str]:
    """Candidates measured at this bandwidth that need more steps before one is chosen:
    those on one step within ``SECOND_LOOK`` of the best, and, of the two fastest, those on
    fewer than ``CONFIRM_SAMPLES`` steps when both are within ``CLOSE`` of the best. Only
    the top two are confirmed: the two that measured fastest are the likeliest to be the
    fastest."""
    at_epoch = {name: measurement for name, measurement in measured.items() if measurement.epoch == epoch}
    second_looks = [name for name, measurement in at_epoch.items()
                    if measurement.samples < 2 and measurement.step_s <= SECOND_LOOK * best]
    top_two = sorted((measurement.step_s, name) for name, measurement in at_epoch.items())[:2]
    if len(top_two) < 2 or top_two[1][0] > CLOSE * best:
        return second_looks
    close = [name for _, name in top_two if at_epoch[name].samples < CONFIRM_SAMPLES]
    return [*second_looks, *(name for name in close if name not in second_looks)]


def estimate(overrides: dict, measurement: Measurement | None, epoch: int, work: Workload,
             links: LinkSpeeds, predicted: float | None = None) -> tuple[float, bool | None]:
    """(seconds, how known) of one candidate's step: measured at this bandwidth (True),
    ``predicted`` from a step measured at another (False), or else a lower bound (None): no
    faster than its inter-node bytes at the inter-node bandwidth."""
    if measurement is not None and measurement.epoch == epoch:
        return measurement.step_s, True
    if measurement is not None and predicted is not None:
        return predicted, False
    # Only the inter-node bytes bound the step: the intra-node bandwidth and the latency
    # are probed on the cores training shares and moved 2x between runs (latency 1.0-2.7
    # ms), which put the two-hop gather's bound at 2.3 s where it ran 0.75 s steps at
    # 200 Mbit/s, so it was never tried.
    return candidate_link_time(work, overrides, links).inter_node_bytes / links.inter_node_bytes_per_s, None


def candidate_link_time(work: Workload, overrides: dict, links: LinkSpeeds) -> LinkTime:
    """The step model's link time of the candidate ``overrides`` makes of the user's config."""
    return link_time(work.flats, work.layout, scheme(work.config, overrides), links, current_backend(),
                     work.accumulation)


def current_backend() -> str:
    """The process group's backend (a plain reduce-scatter moves other bytes on NCCL), gloo when none."""
    return torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
