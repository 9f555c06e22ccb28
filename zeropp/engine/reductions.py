"""Gradient reductions in flight during backward, at most a configured number.

Each reduction holds its unit's full-size gradient (and, on gloo, a full-size receive
buffer) until its collective completes, so keeping every unit's reduction until the end of
backward made the backward peak grow with the whole model. The queue bounds them: before a
new reduction starts, the oldest ones are finished until fewer than ``limit`` remain, and
each finished reduction is added into its master shard's gradient at once, which frees its
buffers; one whose last hop can run on its own is released instead (:meth:`make_room`).
With ``limit=1`` (as FSDP2) one reduction overlaps the backward of the next unit.
"""

from __future__ import annotations

from collections import deque

from ..sharding import FlatParam


class ReductionQueue:
    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self._pending: deque = deque()  # (flat, pending reduction), in start order
        self._crossing: deque = deque()  # released ones whose last hop is in flight
        self.peak_in_flight = 0  # most reductions in flight at once since construction

    def __len__(self) -> int:
        return len(self._pending)

    def make_room(self) -> None:
        """Finish the oldest reductions until one more may start. One whose last hop can run
        on its own (``release``: qgZ's inter-node hop, node accumulation's crossing of the
        node sums) leaves the queue with that hop in flight instead, at most ``limit`` of
        them: it holds only its small rows, and the link works under the next units' backward."""
        while len(self._pending) >= self.limit:
            flat, pending = self._pending[0]
            if not pending.release():
                self._finish_oldest()
                continue
            self._pending.popleft()
            self._crossing.append((flat, pending))
            while len(self._crossing) > self.limit:
                self._finish_crossing()

    def add(self, flat: FlatParam, pending) -> None:
        """``pending`` was just started (after :meth:`make_room`); launch what can be launched."""
        self._pending.append((flat, pending))
        self.peak_in_flight = max(self.peak_in_flight, len(self._pending))
        self.progress()

    def progress(self) -> None:
        """Launch the next hops of the reductions in flight, strictly in start order: every
        rank must issue the hops of a group in the same order."""
        for _, pending in self._pending:
            if not pending.progress():
                break

    def finish_all(self) -> None:
        while self._crossing:
            self._finish_crossing()
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        flat, pending = self._pending.popleft()
        shard = pending.wait()
        if shard is not None:  # None: a micro-step without sync kept its sums inside the node
            flat.accumulate_grad(shard)

    def _finish_crossing(self) -> None:
        flat, pending = self._crossing.popleft()
        flat.accumulate_grad(pending.wait())
