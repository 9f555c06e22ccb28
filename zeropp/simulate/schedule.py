"""The schedule one rank issues in a training step, as the engine issues it: collectives
started, waited on, and the units' compute between them, in host order.

The engine and its communicator report to a :class:`ScheduleRecorder` when one is
attached (``ShardedModel.record_schedule()``); the simulator replays the recorded
:class:`Schedule`, so what is simulated is what zeropp does. A dry run (fake process group,
meta device) records the schedule of a world this machine cannot hold.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Collective:
    """One collective as issued: ``chunk_bytes`` is what each member contributes per peer
    (the accounting's figure); ``algorithm`` is how the backend moves it."""

    op: str  # all_gather | reduce_scatter | all_to_all | all_reduce | broadcast
    algorithm: str  # ring (each member forwards G - 1 chunks) | exchange (one chunk to every peer)
    group_ranks: tuple[int, ...]
    chunk_bytes: int
    phase: str
    dtype: str  # int8/uint8 payloads are quantized: the kernels around them cost time too


# Each recorded event keeps ``at_s``: host seconds since the step's start, where the host
# issued it (a wait: where it returned), so a replay can be held to the step's own timeline.
# On CUDA that is the host's time, not the device's. None in hand-built schedules.


@dataclass(frozen=True)
class Issue:
    collective_id: int
    at_s: float | None = None


@dataclass(frozen=True)
class Wait:
    collective_id: int
    at_s: float | None = None


@dataclass(frozen=True)
class Compute:
    """A unit's compute: ``parameters`` elements used once per token in a matrix product.
    ``kind`` is forward, backward (input and weight gradients) or recompute (activation
    checkpointing's second forward, inside backward)."""

    unit: int
    kind: str
    parameters: int
    at_s: float | None = None


EVENT_TYPES = {"issue": Issue, "wait": Wait, "compute": Compute}


@dataclass
class Schedule:
    """One rank's step. ``tokens_per_rank`` is per micro-step, ``optimizer_parameters`` the
    master elements this rank updates."""

    world_size: int
    ranks_per_node: int
    rank: int
    tokens_per_rank: int = 0
    optimizer_parameters: int = 0
    collectives: list[Collective] = field(default_factory=list)
    events: list[Issue | Wait | Compute] = field(default_factory=list)

    def to_json(self) -> dict:
        names = {kind: name for name, kind in EVENT_TYPES.items()}
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node, "rank": self.rank,
                "tokens_per_rank": self.tokens_per_rank, "optimizer_parameters": self.optimizer_parameters,
                "collectives": [asdict(collective) for collective in self.collectives],
                "events": [{"type": names[type(event)], **asdict(event)} for event in self.events]}

    @classmethod
    def from_json(cls, data: dict) -> Schedule:
        collectives = [Collective(**{**row, "group_ranks": tuple(row["group_ranks"])}) for row in data["collectives"]]
        events = [EVENT_TYPES[row["type"]](**{k: v for k, v in row.items() if k != "type"}) for row in data["events"]]
        return cls(data["world_size"], data["ranks_per_node"], data["rank"], data["tokens_per_rank"],
                   data["optimizer_parameters"], collectives, events)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_json(json.loads(Path(path).read_text()))


class ScheduleRecorder:
    """Collects one rank's :class:`Schedule`. A unit's backward is recorded once per step
    however many of its outputs call the engine's backward hook."""

    def __init__(self, world_size: int, ranks_per_node: int, rank: int) -> None:
        self.schedule = Schedule(world_size, ranks_per_node, rank)
        self._backward_seen: set[tuple[int, str]] = set()
        self._started = time.perf_counter()

    def _now(self) -> float:
        return time.perf_counter() - self._started

    def issued(self, collective: Collective) -> int:
        """Record ``collective`` as started now; returns the id its wait is recorded under."""
        self.schedule.collectives.append(collective)
        collective_id = len(self.schedule.collectives) - 1
        self.schedule.events.append(Issue(collective_id, self._now()))
        return collective_id

    def waited(self, collective_id: int) -> None:
        self.schedule.events.append(Wait(collective_id, self._now()))

    def compute(self, unit: int, kind: str, parameters: int) -> None:
        if kind == "forward":
            self._backward_seen -= {(unit, "backward"), (unit, "recompute")}
        elif (unit, kind) in self._backward_seen:
            return
        else:
            self._backward_seen.add((unit, kind))
        self.schedule.events.append(Compute(unit, kind, parameters, self._now()))

    def reset(self) -> None:
        """Start a new step's schedule (the previous one is dropped)."""
        self.schedule = Schedule(self.schedule.world_size, self.schedule.ranks_per_node, self.schedule.rank)
        self._backward_seen.clear()
        self._started = time.perf_counter()
