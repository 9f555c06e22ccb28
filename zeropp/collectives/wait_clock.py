"""How long computation waited for communication: the communication it did not hide.

On the CPU (gloo) ``work.wait()`` blocks the host until the data is there, so the host's
blocked time is the wait. On CUDA (NCCL) ``work.wait()`` returns at once: it only makes the
compute stream wait for the communication stream, so the host clock reads about zero. There
the clock records a CUDA event on the compute stream before and after each wait; the time
between them is how long the stream stalled. Events are read when the figure is asked for
(once a step), so the hot path gains no host synchronisation.
"""

from __future__ import annotations

import time

import torch


class WaitClock:
    def __init__(self) -> None:
        self._seconds = 0.0  # resolved, not yet taken
        self._taken = 0.0  # handed out by take()
        self._events: list[tuple] = []  # (before, after) CUDA event pairs not yet read

    def measure(self, device: torch.device, wait) -> None:
        """Run ``wait()`` and account the wait it causes on ``device``."""
        if device.type == "cuda":
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            try:
                wait()
            finally:
                after.record()
                self._events.append((before, after))
            return
        started = time.perf_counter()
        try:
            wait()
        finally:
            self._seconds += time.perf_counter() - started

    def _resolve(self) -> None:
        """Read the recorded stalls (synchronises with the events: call outside the hot path)."""
        for before, after in self._events:
            after.synchronize()
            self._seconds += before.elapsed_time(after) / 1000.0
        self._events.clear()

    def take(self) -> float:
        """Seconds waited since the last call."""
        self._resolve()
        seconds, self._seconds = self._seconds, 0.0
        self._taken += seconds
        return seconds

    @property
    def total(self) -> float:
        """Seconds waited since construction (never reset)."""
        self._resolve()
        return self._taken + self._seconds
