"""Auto mode: pick the communication scheme for the network the job finds, and pick again
when the network changes (docs/design.md section 11).

At the first training step the tuner probes the links (:mod:`zeropp.auto.probe`). It then
*tries* candidates for ``TRIAL_STEPS`` steps each (the first one step more), cheapest link
first, and keeps a candidate's compute time (step minus the time blocked in collectives).
A candidate is only tried while it could still win: its step cannot be shorter than its
inter-node bytes take at the inter-node bandwidth. (ZeRO-3's compute is no bound on the
quantized candidates on shared cores: moving 4x the bytes costs CPU time outside the time
blocked, and zero++'s whole step measured shorter than ZeRO-3's compute at 1 Gbit/s.)
Nor is a candidate ruled out, or a close call decided, on one step: once every candidate
worth trying has been tried, each measured on one step within 25% of the best gets a
second look (a step on shared cores can run 24% slow), and while the two fastest measured
are within 15% of each other and either has fewer than ``CONFIRM_SAMPLES`` measured steps,
the one with fewer runs again (the running one first: it needs no warm-up step); a figure
is the median of its steps. Nor is any choice made on one step: the fastest keeps running
as a trial until it has ``CONFIRM_SAMPLES`` measured steps (those steps run the candidate
that would be chosen anyway, so they cost nothing unless it was lucky).

Then it runs the fastest. Every ``auto_probe_every`` steps the running candidate's median
step replaces its trial figure (one measured step can be lucky; another candidate 10%
faster is then measured afresh, and takes over if still 10% faster once confirmed). The
inter-node link is probed then if the running choice's last steps moved, else at every
sixth look; in the trials every ``auto_probe_every`` steps. When the bandwidth moves by
more than 2x, twice in a row (a second probe at once: one short probe can be an outlier),
it re-plans, dropping the trial steps measured since the probe before, which may have run
on either link: the step simulator replays every measured candidate's own recorded step at
the new links (:mod:`zeropp.auto.replay`; the engine records the steps of each trial),
candidates never measured are tried if they could win, and the fastest prediction is tried
until confirmed. A prediction keeps what the replay did not explain at the old links (the
measured step less the replayed one, mostly time blocked on shared cores): without it every
prediction undercut the measured running choice, and each took over in turn.

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
from dataclasses import dataclass

import torch

from ..accounting import FlatSummary
from ..collectives import Communicator
from ..config import ZeroConfig
from ..simulate.schedule import Schedule, ScheduleRecorder
from ..topology import Topology
from .candidates import candidates, scheme
from .planning import Measurement, Workload, plan_next
from .probe import PHASE, LinkProbe
from .replay import predicted_step_s
from .step_model import Accumulation, LinkSpeeds

logger = logging.getLogger(__name__)

TRIAL_STEPS = 2  # the first step after a switch builds caches; the second is measured
# The job's first trial measures its third step: in the second the process is still warming
# up (measured 4-80% slower than the same scheme's median on the emulated cluster), which
# ruled out whichever candidate happened to be tried first.
FIRST_TRIAL_STEPS = 3
STEADY_WINDOW = 20  # steps of the running choice whose median stands for it
# In the steady state a challenger is tried again, and takes over, only when 10% faster than
# the running choice: 20-step medians of one fixed scheme wander by up to +-10% over a run on
# the emulated cluster (zero++ at 1 Gbit/s: 537-668 ms), and with 3% the running choice's
# fresh median chased other candidates' earlier figures (five switches in one 100-step run).
STEADY_MARGIN = 0.90
REPLAN_FACTOR = 2.0
# In the steady state the link is probed only when the median of the running choice's last
# RECENT_STEPS steps moved by more than STEP_MOVED against its figure (a link 2x slower or
# faster moves a step that waits on it), or at every QUIET_PROBES-th look: a probe every 5
# steps cost 3% of a 1 Gbit/s run (about 70 ms against 480 ms steps).
RECENT_STEPS = 3
STEP_MOVED = 1.2
QUIET_PROBES = 6


class AutoState(enum.Enum):
    TRIAL = "trial"  # running a candidate for a few steps to measure it
    STEADY = "steady"  # running the chosen candidate, probing the link now and then


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
        self.accumulation = Accumulation()  # of the optimizer step that just ended
        self._epoch = self._steps_in_state = self._step = 0
        self._warm_steps = FIRST_TRIAL_STEPS - 1  # steps of the running trial not measured
        self._times: list[tuple[float, float]] = []  # (step, blocked) seconds of this rank since the last switch
        # (step index, step seconds, compute seconds), the slowest rank's, of each trial step
        # measured, by candidate and epoch
        self._samples: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
        self._probed_at = self._previous_probe = 0  # step indices of the last two link probes
        self._clock: tuple[float, float] | None = None  # (time, total wait) at the step's start
        self._incumbent: str | None = None  # the steady choice a challenger on trial must beat
        # Trial steps as the engine issues them (attached to the communicator while trying),
        # and the candidates measured on other links predicted at these, for this epoch.
        layout = topology.layout
        self._recorder = ScheduleRecorder(layout.world_size, layout.ranks_per_node, topology.rank)
        self._step_schedule: Schedule | None = None  # the step that just ended, if recorded
        self._predicted: dict[str, float] = {}

    def applied_to(self, config: ZeroConfig) -> ZeroConfig:
        """``config`` with the chosen schemes: what the engine's strategies run."""
        return scheme(config, self.candidates[self.choice])

    def before_step(self, flats: list[FlatSummary], accumulation: Accumulation = Accumulation()) -> bool:
        """Call before each optimizer step's first forward with the model's flat buffers
        and the micro-steps the last optimizer step ran; True when the choice changed."""
        self.flats, self.accumulation = flats, accumulation
        elapsed = self._read_clock()
        events = self._recorder.schedule.events
        self._step_schedule = self._recorder.schedule if events else None
        previous = self.choice
        if self.state is None:
            self._start()
        elif self.state is AutoState.TRIAL:
            self._trial_step(elapsed)
        else:
            self._steady_step(elapsed)
        self._recorder.reset()  # the next step's schedule, without this call's probes
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
        trial goes on (a close call), another candidate is tried, or one is chosen. The
        link is probed every ``auto_probe_every`` steps here too: a change found only after
        the trials left each trial step after it measured on the new link against figures
        from the old (16 steps to re-plan in the replan benchmark, against 9)."""
        self._times.append(elapsed)
        measured = len(self._times) > self._warm_steps
        if measured:
            step_s, waited_s = self._times[-1]
            samples = self._samples.setdefault((self.choice, self._epoch), [])
            samples.append((self._step, *self._slowest_rank(step_s, step_s - waited_s)))
            self._measure(self.choice, samples)
        if self._step - self._probed_at >= self.config.auto_probe_every:
            links = self._changed_links()
            if links is not None:
                self._replan(links)
                return
        if measured:
            self._next_trial_or_choose()

    def _measure(self, name: str, samples: list[tuple[int, float, float]]) -> None:
        self.measured[name] = Measurement(statistics.median(step for _, step, _ in samples),
                                          statistics.median(compute for _, _, compute in samples),
                                          self._epoch, len(samples), self.links, self._schedule_of(name))

    def _steady_step(self, elapsed: tuple[float, float]) -> None:
        """Every ``auto_probe_every`` steps: the running choice's median step replaces its
        figure (one step can be lucky). The link is probed when its last steps moved by more
        than ``STEP_MOVED``, or after ``QUIET_PROBES`` looks without a probe. A new
        bandwidth re-plans; otherwise a candidate known to be 10% faster is tried again."""
        self._times = [*self._times, elapsed][-STEADY_WINDOW:]
        self._steps_in_state += 1
        every = self.config.auto_probe_every
        # Not before two steps: the first after a switch builds caches.
        if not self.probe.crosses_nodes or self._steps_in_state % every or len(self._times) < 2:
            return
        steps = self._times[1:]
        step_s, compute_s, recent_s = self._slowest_rank(
            statistics.median(step for step, _ in steps), statistics.median(step - waited for step, waited in steps),
            statistics.median(step for step, _ in steps[-RECENT_STEPS:]))
        before_s = self.measured[self.choice].step_s
        self.measured[self.choice] = Measurement(step_s, compute_s, self._epoch, len(steps), self.links,
                                                 self._schedule_of(self.choice))
        self._samples.pop((self.choice, self._epoch), None)  # the window's figure stands for it now
        moved = max(recent_s / before_s, before_s / recent_s) > STEP_MOVED
        if moved or self._step - self._probed_at >= QUIET_PROBES * every:
            links = self._changed_links()
            if links is not None:
                self._replan(links)
                return
        self._next_trial_or_choose(steady=True)

    def _replan(self, links: LinkSpeeds) -> None:
        """A new epoch at the new links. Trial steps measured since the probe before the one
        that found the change may have run on either link: they are dropped, and a candidate
        left with none is untried again."""
        logger.debug("auto: inter-node bandwidth %.0f -> %.0f Mbit/s", _mbit(self.links), _mbit(links))
        for (name, epoch), samples in self._samples.items():
            kept = [sample for sample in samples if sample[0] <= self._previous_probe]
            if epoch != self._epoch or len(kept) == len(samples):
                continue
            samples[:] = kept
            if kept:
                self._measure(name, kept)
            else:
                del self.measured[name]
        self.links, self._epoch, self._incumbent = links, self._epoch + 1, None
        self._predicted = self._predictions()
        self._next_trial_or_choose()

    def _predictions(self) -> dict[str, float]:
        """Each candidate measured on other links, its recorded step replayed on these. A
        rank replays its own schedule: the slowest rank's figure is kept, so every rank
        plans the same. A candidate without a recorded step is left out (tried again if it
        could win)."""
        names, values = list(self.candidates), []
        for name in names:
            measured = self.measured.get(name)
            if measured is None or measured.epoch == self._epoch or measured.schedule is None or measured.links is None:
                values.append(-1.0)
                continue
            values.append(predicted_step_s(measured.step_s, measured.compute_s, measured.schedule, measured.links,
                                           self.links))
        agreed = self._slowest_rank(*values)
        return {name: value for name, value in zip(names, agreed) if value >= 0}

    def _changed_links(self) -> LinkSpeeds | None:
        """The links now when two probes in a row find the inter-node bandwidth moved more
        than ``REPLAN_FACTOR`` the same way; else None."""
        expected = self.links.inter_node_bytes_per_s
        self._previous_probe, self._probed_at = self._probed_at, self._step
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
        plan = plan_next(self.candidates, self.measured, self._epoch, self._workload(), self.links, self.choice,
                         close_calls=not steady, predicted=self._predicted)
        # A second look, a close call or an unconfirmed lead: the running one measures on.
        # (At the start nothing has run: a first trial of the candidate the tuner starts on
        # still starts.)
        if plan.trial == self.choice and self.state is not None:
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
        # Steps are recorded while trying only: a steady run (or a generation loop) between
        # optimizer steps keeps no growing schedule. A schedule the user records takes over
        # the communicator meanwhile; its steps are not this tuner's.
        if state is AutoState.TRIAL and self.communicator.schedule is None:
            self.communicator.schedule = self._recorder
        elif state is AutoState.STEADY and self.communicator.schedule is self._recorder:
            self.communicator.schedule = None

    def _schedule_of(self, name: str) -> Schedule | None:
        """The recorded step of ``name``: the one that just ended if it ran ``name``, else
        the one its measurement keeps."""
        if name == self.choice and self._step_schedule is not None:
            return self._step_schedule
        measured = self.measured.get(name)
        return measured.schedule if measured is not None else None

    def _workload(self) -> Workload:
        return Workload(self.flats, self.topology.layout, self.config, self.accumulation)

    # ----------------------------------------------------------------- timing
    def _read_clock(self) -> tuple[float, float]:
        """(seconds since the last step started, of which blocked in collectives)."""
        if self._clock is None:
            return 0.0, 0.0
        started, waited = self._clock
        return time.perf_counter() - started, self.communicator.total_wait_seconds - waited

    def _slowest_rank(self, *seconds: float) -> tuple[float, ...]:
        """Figures (seconds) of the slowest rank, each its maximum: every rank then decides the same."""
        figures = torch.tensor(seconds, dtype=torch.float64, device=self.topology.device)
        self.communicator.all_reduce_max(figures, self.topology.group("world"), PHASE)
        return tuple(figures.tolist())


def _mbit(links: LinkSpeeds) -> float:
    return links.inter_node_bytes_per_s * 8e-6
