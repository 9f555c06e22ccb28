"""Auto mode: pick the communication scheme for the network the job finds, and pick again
when the network changes (docs/design.md section 11).

At the first training step the tuner probes the links (:mod:`zeropp.auto.probe`). It then
*tries* candidates for ``TRIAL_STEPS`` steps each (the first one step more), cheapest link
first, and keeps a candidate's compute time (step minus the time blocked in collectives).
A candidate is only tried while it could still win: its step cannot be shorter than its
inter-node bytes take at the inter-node bandwidth, nor than ZeRO-3's compute once that is
known from ``CONFIRM_SAMPLES`` steps (quantization only adds work).
A close call is not decided on one step: once every candidate worth trying has been
tried, while the two fastest measured are within 15% of each other and either has fewer
than ``CONFIRM_SAMPLES`` measured steps, the one with fewer runs again (the running one
first: it needs no warm-up step); a figure is the median of its steps. Nor is any choice
made on one step: the fastest keeps running as a trial until it has ``CONFIRM_SAMPLES``
measured steps (those steps run the candidate that would be chosen anyway, so they cost
nothing unless it was lucky).

Then it runs the fastest. Every ``auto_probe_every`` steps the running candidate's median
step replaces its trial figure (one measured step can be lucky; another candidate 10%
faster is then measured afresh, and takes over if still 10% faster once confirmed), and
the inter-node link is probed. When the bandwidth moves by more than 2x, twice in a row
(a second probe at once: one short probe can be an outlier), it re-plans: the step model
(:mod:`zeropp.auto.step_model`) predicts every measured candidate at the new bandwidth,
candidates never measured are tried if they could win, and the fastest prediction is tried
until confirmed. A prediction keeps what the model did not explain at the old bandwidth
(the measured step less the model's step, mostly time blocked on shared cores): without it
every prediction undercut the measured running choice, and each took over in turn.

Every figure a decision uses is the slowest rank's (all-reduced), so every rank decides
the same. Candidates change only which schemes are on; bits, grids, block size and chunks
stay the user's.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
import time
from dataclasses import dataclass, replace

import torch

from ..accounting import FlatSummary
from ..collectives import Communicator
from ..config import ZeroConfig
from ..topology import Layout, Topology
from .probe import PHASE, LinkProbe
from .step_model import LinkSpeeds, link_time, step_seconds

logger = logging.getLogger(__name__)

TRIAL_STEPS = 2  # the first step after a switch builds caches; the second is measured
# The job's first trial measures its third step: in the second the process is still warming
# up (measured 4-80% slower than the same scheme's median on the emulated cluster), which
# ruled out whichever candidate happened to be tried first.
FIRST_TRIAL_STEPS = 3
STEADY_WINDOW = 20  # steps of the running choice whose median stands for it
WORTH_TRYING = 0.97  # try a candidate only if it might be 3% faster than the best so far
# In the steady state a challenger is tried again, and takes over, only when 10% faster than
# the running choice: 20-step medians of one fixed scheme wander by up to +-10% over a run on
# the emulated cluster (zero++ at 1 Gbit/s: 537-668 ms), and with 3% the running choice's
# fresh median chased other candidates' earlier figures (five switches in one 100-step run).
STEADY_MARGIN = 0.90
# One step of a shared machine moves by 10-20% in a job's first steps (the fixed runs of the
# emulated cluster, against their medians): candidates measured within CLOSE of the best
# are each measured on CONFIRM_SAMPLES steps before one is chosen. Being close, the extra
# steps cost little.
CLOSE = 1.15  # 1.05 chose zero++ over the two-hop gather, 906 ms to 996, where they run 830 and 760
CONFIRM_SAMPLES = 3
REPLAN_FACTOR = 2.0


def candidates(ranks_per_node: int) -> dict[str, dict[str, object]]:
    """The schemes auto mode chooses from, as config overrides, exact ZeRO-3 first."""
    choices = candidate_schemes(ranks_per_node)
    if ranks_per_node == 1:  # a node of one rank: no secondary to share, the two-hop gather is a ring
        return {name: choices[name] for name in ("zero3", "qwz", "qgz", "qwz+qgz")}
    return choices


def candidate_schemes(ranks_per_node: int) -> dict[str, dict[str, object]]:
    """All seven candidates as config overrides, also where a node of one rank makes some
    of them equal (the benchmarks run them by name on any layout)."""
    off = {"quantized_weights": False, "two_hop_weight_gather": False, "hpz_size": 1, "quantized_gradients": False}
    hpz = {"hpz_size": ranks_per_node}
    return {
        "zero3": off,
        "hpz": {**off, **hpz},
        "qwz": {**off, "quantized_weights": True},
        "qgz": {**off, "quantized_gradients": True},
        "qwz+qgz": {**off, "quantized_weights": True, "quantized_gradients": True},
        "zero++": {**off, "quantized_weights": True, "quantized_gradients": True, **hpz},
        "zero++-two-hop": {**off, "quantized_weights": True, "quantized_gradients": True, "two_hop_weight_gather": True,
                           **hpz},
    }


class AutoState(enum.Enum):
    TRIAL = "trial"  # running a candidate for a few steps to measure it
    STEADY = "steady"  # running the chosen candidate, probing the link now and then


@dataclass(frozen=True)
class Measurement:
    step_s: float  # median of the measured steps
    compute_s: float  # step less the time blocked in collectives (median)
    epoch: int  # which bandwidth (plan) it was measured under
    samples: int = 1  # measured steps behind the figures
    link_s: float | None = None  # the candidate's link time at the bandwidth measured under

    def unexplained_s(self, num_flats: int) -> float:
        """The measured step less the step model's at the bandwidth it was measured under."""
        if self.link_s is None:
            return 0.0
        return self.step_s - step_seconds(self.compute_s, self.link_s, num_flats)


@dataclass(frozen=True)
class Decision:
    step: int
    choice: str
    inter_node_mbit: float
    reason: str


class AutoTuner:
    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config, self.topology, self.communicator = config, topology, communicator
        self.flats: list[FlatSummary] = []
        self.candidates = candidates(topology.ranks_per_node)
        self.probe = LinkProbe(topology, communicator)
        self.state: AutoState | None = None  # None until the first training step
        self.choice = "zero3"
        self.links: LinkSpeeds | None = None
        self.measured: dict[str, Measurement] = {}
        self.decisions: list[Decision] = []
        self._epoch = self._steps_in_state = self._step = 0
        self._warm_steps = FIRST_TRIAL_STEPS - 1  # steps of the running trial not measured
        self._times: list[tuple[float, float]] = []  # (step, blocked) seconds of this rank since the last switch
        # (step, compute) seconds, the slowest rank's, of each trial step measured at this epoch
        self._samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self._clock: tuple[float, float] | None = None  # (time, total wait) at the step's start
        self._incumbent: str | None = None  # the steady choice a challenger on trial must beat

    def applied_to(self, config: ZeroConfig) -> ZeroConfig:
        """``config`` with the chosen schemes: what the engine's strategies run."""
        return scheme(config, self.candidates[self.choice])

    def before_step(self, flats: list[FlatSummary]) -> bool:
        """Call before each training step's forward with the model's flat buffers; True
        when the choice changed."""
        self.flats = flats
        elapsed = self._read_clock()
        previous = self.choice
        if self.state is None:
            self._start()
        elif self.state is AutoState.TRIAL:
            self._trial_step(elapsed)
        else:
            self._steady_step(elapsed)
        self._step += 1
        self._clock = (time.perf_counter(), self.communicator.total_wait_seconds)  # probes excluded
        return self.choice != previous

    # ----------------------------------------------------------------- states
    def _start(self) -> None:
        self.links = self.probe.measure_all()
        if not self.probe.crosses_nodes:
            self._decide("zero3", "one node: nothing crosses a node link")
            return
        self._next_trial_or_choose()

    def _trial_step(self, elapsed: tuple[float, float]) -> None:
        """Every step after the warm-up ones is a sample; the plan then says whether this
        trial goes on (a close call), another candidate is tried, or one is chosen."""
        self._times.append(elapsed)
        if len(self._times) <= self._warm_steps:
            return
        step_s, waited_s = self._times[-1]
        samples = self._samples.setdefault((self.choice, self._epoch), [])
        samples.append(self._slowest_rank(step_s, step_s - waited_s))
        self.measured[self.choice] = Measurement(statistics.median(step for step, _ in samples),
                                                 statistics.median(compute for _, compute in samples),
                                                 self._epoch, len(samples), self._link_seconds(self.choice))
        self._next_trial_or_choose()

    def _steady_step(self, elapsed: tuple[float, float]) -> None:
        """Every ``auto_probe_every`` steps: the running choice's median step replaces its
        trial figure (one step can be lucky), then the link is probed. A new bandwidth
        re-plans; otherwise a candidate known to be 10% faster is tried again."""
        self._times = [*self._times, elapsed][-STEADY_WINDOW:]
        self._steps_in_state += 1
        if not self.probe.crosses_nodes or self._steps_in_state % self.config.auto_probe_every:
            return
        if len(self._times) > 1:  # the first step after a switch builds caches
            steps = self._times[1:]
            figures = self._slowest_rank(statistics.median(step for step, _ in steps),
                                         statistics.median(step - waited for step, waited in steps))
            self.measured[self.choice] = Measurement(*figures, self._epoch, len(steps),
                                                     self._link_seconds(self.choice))
        links = self._changed_links()
        if links is not None:
            logger.debug("auto: inter-node bandwidth %.0f -> %.0f Mbit/s", _mbit(self.links), _mbit(links))
            self.links, self._epoch, self._incumbent = links, self._epoch + 1, None
            self._next_trial_or_choose()
        else:
            self._next_trial_or_choose(steady=True)

    def _changed_links(self) -> LinkSpeeds | None:
        """The links now when two probes in a row find the inter-node bandwidth moved more
        than ``REPLAN_FACTOR`` the same way; else None."""
        expected = self.links.inter_node_bytes_per_s
        probes = []
        for _ in range(2):
            probes.append(self.probe.measure_inter_node(probes[-1].inter_node_bytes_per_s if probes else expected))
            ratio = probes[-1].inter_node_bytes_per_s / expected
            if max(ratio, 1 / ratio) <= REPLAN_FACTOR:
                return None
        first, second = (probe.inter_node_bytes_per_s > expected for probe in probes)
        return probes[-1] if first == second else None

    # ----------------------------------------------------------------- planning
    def _next_trial_or_choose(self, steady: bool = False) -> None:
        # Close calls are settled while trying; in the steady state only a challenger
        # STEADY_MARGIN faster is tried, and it takes over only if still that much faster
        # once re-measured (else the incumbent runs on).
        plan = plan_next(self.candidates, self.measured, self._epoch,
                         Workload(self.flats, self.topology.layout, self.config), self.links, self.choice,
                         close_calls=not steady)
        if plan.trial == self.choice:  # a close call or an unconfirmed lead: the running one measures on
            return
        incumbent, leader = self.choice if steady else self._incumbent, plan.trial or plan.choice
        if incumbent is not None and plan.estimates[leader][0] >= STEADY_MARGIN * plan.estimates[incumbent][0]:
            if not steady:  # the challenger, re-measured, is not enough faster
                self._decide(incumbent, plan.reason)
            return
        if steady:  # the challenger is measured afresh: its earlier steps ran on a machine that wanders
            self._samples.pop((leader, self._epoch), None)
            self._incumbent = incumbent
            self._set(AutoState.TRIAL, leader)
            return
        if plan.trial is not None:
            self._set(AutoState.TRIAL, plan.trial)
            return
        self._decide(plan.choice, plan.reason)

    def _decide(self, name: str, reason: str) -> None:
        self._set(AutoState.STEADY, name)
        self._incumbent = None
        mbit = _mbit(self.links) if self.links else math.inf
        self.decisions.append(Decision(self._step, name, mbit, reason))
        if self.topology.rank == 0:
            logger.info("auto mode at step %d: %s (inter-node %.0f Mbit/s, intra-node %.0f Mbit/s, latency %.2f ms); %s",
                        self._step, name, mbit, self.links.intra_node_bytes_per_s * 8e-6 if self.links else math.inf,
                        self.probe.latency_s * 1e3, reason)

    def _set(self, state: AutoState, name: str) -> None:
        self._warm_steps = (TRIAL_STEPS if self.measured else FIRST_TRIAL_STEPS) - 1
        self.state, self.choice = state, name
        self._steps_in_state = 0
        self._times = []

    def _link_seconds(self, name: str) -> float:
        """Candidate ``name``'s link time at the links now (kept with its measurement)."""
        config = scheme(self.config, self.candidates[name])
        return link_time(self.flats, self.topology.layout, config, self.links, _backend()).seconds

    # ----------------------------------------------------------------- timing
    def _read_clock(self) -> tuple[float, float]:
        """(seconds since the last step started, of which blocked in collectives)."""
        if self._clock is None:
            return 0.0, 0.0
        started, waited = self._clock
        return time.perf_counter() - started, self.communicator.total_wait_seconds - waited

    def _slowest_rank(self, step_s: float, compute_s: float) -> tuple[float, float]:
        """(step, compute) seconds of the slowest rank: every rank then decides the same."""
        figures = torch.tensor([step_s, compute_s], dtype=torch.float64, device=self.topology.device)
        self.communicator.all_reduce_max(figures, self.topology.group("world"), PHASE)
        return figures[0].item(), figures[1].item()


@dataclass(frozen=True)
class Workload:
    flats: list[FlatSummary]
    layout: Layout
    config: ZeroConfig  # the user's; candidates override its scheme fields


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
              links: LinkSpeeds, running: str | None = None, close_calls: bool = True) -> Plan:
    """The next candidate to try, or the one to run. ZeRO-3, when running as a trial,
    first measures ``CONFIRM_SAMPLES`` steps. Then a candidate is tried when it might beat
    the best known by more than 3%: first the cheapest bound (ZeRO-3 first among equals),
    then ZeRO-3 if it is among them, then the cheapest bound again. Then a close call (the
    two fastest measured within 15%) measures more steps, the running side first. Then
    the fastest, tried until measured on ``CONFIRM_SAMPLES`` steps at this bandwidth, or
    run. ``close_calls=False`` skips close calls (the steady state)."""
    estimates = {name: estimate(name, overrides, measured.get(name), epoch, work, links, measured.get("zero3"))
                 for name, overrides in choices.items()}
    known = {name: seconds for name, (seconds, how) in estimates.items() if how is not None}
    best = min(known.values(), default=math.inf)
    zero3 = measured.get("zero3")
    zero3_unconfirmed = zero3 is not None and zero3.epoch == epoch and zero3.samples < CONFIRM_SAMPLES
    if close_calls and running == "zero3" and zero3_unconfirmed:
        # ZeRO-3's compute bounds every other candidate, so it is measured on
        # CONFIRM_SAMPLES steps: its second step after a switch took 1.4x its fixed runs'
        # median at 1 Gbit/s and bounded zero++ out of the trials.
        return Plan("zero3", None, estimates)
    untried = [(seconds, list(choices).index(name), name) for name, (seconds, how) in estimates.items()
               if how is None and seconds < WORTH_TRYING * best]
    if untried:
        # Once anything is known, ZeRO-3 goes first when worth trying: its compute time
        # bounds every other candidate's, which usually spares their trials.
        zero3_first = known and any(name == "zero3" for _, _, name in untried)
        return Plan("zero3" if zero3_first else min(untried)[2], None, estimates)
    # Close calls are settled once every candidate worth trying has been tried: settled
    # earlier, each candidate near the best ran CONFIRM_SAMPLES steps (all seven at 1 Gbit/s).
    unconfirmed = _unconfirmed_close_calls(measured, epoch, best) if close_calls else []
    if running in unconfirmed:  # it measures on without a warm-up step
        return Plan(running, None, estimates)
    if unconfirmed:
        return Plan(min(unconfirmed, key=lambda name: (measured[name].samples, measured[name].step_s)), None,
                    estimates)
    leader = min(known, key=known.get)
    if not _confirmed(measured[leader], epoch):  # predicted, or measured on too few steps
        return Plan(leader, None, estimates)
    return Plan(None, leader, estimates)


def _confirmed(measurement: Measurement, epoch: int) -> bool:
    return measurement.epoch == epoch and measurement.samples >= CONFIRM_SAMPLES


def _unconfirmed_close_calls(measured: dict[str, Measurement], epoch: int, best: float) -> list[str]:
    """Of the two fastest candidates measured at this bandwidth, those on fewer than
    ``CONFIRM_SAMPLES`` steps when both are within ``CLOSE`` of the best. Only the top two:
    the two that measured fastest are the likeliest to be the fastest."""
    top_two = sorted((measurement.step_s, name) for name, measurement in measured.items()
                     if measurement.epoch == epoch)[:2]
    if len(top_two) < 2 or top_two[1][0] > CLOSE * best:
        return []
    return [name for _, name in top_two if measured[name].samples < CONFIRM_SAMPLES]


def estimate(name: str, overrides: dict, measurement: Measurement | None, epoch: int, work: Workload,
             links: LinkSpeeds, zero3: Measurement | None) -> tuple[float, bool | None]:
    """(seconds, how known) of one candidate's step: measured at this bandwidth (True),
    predicted by the step model from its compute time, plus what the model left
    unexplained when it was measured (False), or, never measured, a lower bound (None): no
    faster than its inter-node bytes at the inter-node bandwidth, nor than ZeRO-3's compute
    once measured on ``CONFIRM_SAMPLES`` steps."""
    link = link_time(work.flats, work.layout, scheme(work.config, overrides), links, _backend())
    if measurement is None:
        # Only the inter-node bytes bound the step: the intra-node bandwidth and the latency
        # are probed on the cores training shares and moved 2x between runs (latency 1.0-2.7
        # ms), which put the two-hop gather's bound at 2.3 s where it ran 0.75 s steps at
        # 200 Mbit/s, so it was never tried.
        inter_node = link.inter_node_bytes / links.inter_node_bytes_per_s
        confirmed_zero3 = zero3 is not None and zero3.samples >= CONFIRM_SAMPLES
        return max(inter_node, zero3.compute_s if confirmed_zero3 else 0.0), None
    if measurement.epoch == epoch:
        return measurement.step_s, True
    num_flats = len(work.flats)
    predicted = step_seconds(measurement.compute_s, link.seconds, num_flats) + measurement.unexplained_s(num_flats)
    return max(predicted, measurement.compute_s), False


def scheme(config: ZeroConfig, overrides: dict[str, object]) -> ZeroConfig:
    """The fixed-scheme config a candidate runs (auto off: the choice is made)."""
    return replace(config, auto=False, **overrides)


def _mbit(links: LinkSpeeds) -> float:
    return links.inter_node_bytes_per_s * 8e-6


def _backend() -> str:
    return torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
