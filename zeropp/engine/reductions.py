"""Gradient reductions in flight during backward, at most a configured number.

Each reduction holds its unit's full-size gradient (and, on gloo, a full-size receive
buffer) until its collective completes, so keeping every unit's reduction until the end of
backward made the backward peak grow with the whole model. The queue bounds them: before a
new reduction starts, the oldest ones are waited for until fewer than ``limit`` remain, and
each finished reduction is added into its master shard's gradient at once, which frees its
buffers. With ``limit=1`` (as FSDP2) one reduction overlaps the backward of the next unit.
"""

from __future__ import annotations

from collections import deque

from ..sharding import FlatParam


class ReductionQueue:
    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self._pending: deque = deque()  # (flat, pending reduction), in start order
        self.peak_in_flight = 0  # most reductions in flight at once since construction

    def __len__(self) -> int:
        return len(self._pending)

    def make_room(self) -> None:
        """Finish the oldest reductions until one more may start."""
        while len(self._pending) >= self.limit:
            self._finish_oldest()

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
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        flat, pending = self._pending.popleft()
        shard = pending.wait()
        if shard is not None:  # None: a micro-step without sync kept its sums inside the node
            flat.accumulate_grad(shard)
