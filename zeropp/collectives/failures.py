"""Turning a failed or mismatched collective into an error that says who and where.

A rank that crashes makes its peers' gloo calls fail at once ("connection reset"); a rank
that hangs makes them time out after the process group's timeout. Either way each
surviving rank reports itself in the rendezvous store and waits a short grace period: the
ranks that never report are the ones that crashed or hung, and the error names them with
the collective (op, phase, unit) the survivors were waiting on.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

GRACE_SECONDS = 3.0


class CollectiveError(RuntimeError):
    """A collective failed: a peer crashed, hung past the timeout, or the link broke."""


class CollectiveOrderError(RuntimeError):
    """Ranks issued different collectives at the same point (divergent control flow)."""


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    group: str
    phase: str
    label: str
    numel: int
    dtype: str

    def describe(self) -> str:
        return f"{self.op} of {self.numel} {self.dtype} on {self.group} group ({self.phase}, unit {self.label or '-'})"


def gather_fingerprints(call: CollectiveCall, group_handle, group_size: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(this member's fingerprint [1], every member's [group_size]) int64 on ``device``: the
    backend's device (NCCL gathers CUDA tensors only)."""
    # A stable digest: Python's hash() of strings differs between processes.
    digest = int.from_bytes(hashlib.blake2b(call.describe().encode(), digest_size=7).digest(), "little")
    fingerprint = torch.tensor([digest], dtype=torch.int64, device=device)
    everyone = torch.empty(group_size, dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, fingerprint, group=group_handle)
    return fingerprint, everyone


class TrackedWork:
    """A collective in flight; ``wait`` converts backend failures into CollectiveError."""

    def __init__(self, work, call: CollectiveCall, rank: int, world_size: int, clock, device: torch.device,
                 on_wait=None) -> None:
        self.work = work
        self.call = call
        self.rank = rank
        self.world_size = world_size
        self.started = time.monotonic()
        self._clock = clock  # the communicator's WaitClock
        self._device = device
        self._on_wait = on_wait  # told when the wait returns (a schedule being recorded)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        try:
            self._clock.measure(self._device, self.work.wait)
        except RuntimeError as error:
            raise collective_error(self.call, self.rank, self.world_size, self.started, error) from error
        if self._on_wait is not None:
            self._on_wait()


def collective_error(call: CollectiveCall, rank: int, world_size: int, started: float, error: Exception) -> CollectiveError:
    waited = time.monotonic() - started
    suspects = _silent_ranks(rank, world_size)
    return CollectiveError(
        f"rank {rank}: {call.describe()} failed after {waited:.1f}s. Ranks that did not report this "
        f"failure within {GRACE_SECONDS:.0f}s (crashed or hung): {suspects}. Backend said: {str(error)[:240]}"
    )


def _silent_ranks(rank: int, world_size: int) -> str:
    """Ranks that did not announce the failure in the store within the grace period. Behind
    a broken link the store (hosted with rank 0) may not answer at all, and a store request
    can block past any timeout: ask in a thread and stop waiting after the grace period."""
    answer = ["unknown: the rendezvous store (hosted with rank 0) did not answer, so rank 0's side is among them"]
    asking = threading.Thread(target=lambda: answer.__setitem__(0, _ask_store(rank, world_size)), daemon=True)
    asking.start()
    asking.join(GRACE_SECONDS + 2.0)
    return answer[0]


def _ask_store(rank: int, world_size: int) -> str:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"zeropp/failed/{rank}", "1")
        deadline = time.monotonic() + GRACE_SECONDS
        silent = set(range(world_size))
        while silent and time.monotonic() < deadline:
            silent = {r for r in silent if not store.check([f"zeropp/failed/{r}"])}
            time.sleep(0.1)
        return str(sorted(silent))
    except Exception:  # the store lives in rank 0's process
        return "unknown: the rendezvous store (hosted by rank 0) is unreachable, so rank 0 is one of them"


def check_same_call(call: CollectiveCall, group_handle, group_size: int, device: torch.device) -> None:
    """Debug mode: all members compare a fingerprint of the call they are about to make."""
    fingerprint, everyone = gather_fingerprints(call, group_handle, group_size, device)
    if (everyone == fingerprint).all():
        return
    calls = [None] * group_size
    dist.all_gather_object(calls, call.describe(), group=group_handle)
    listing = "; ".join(f"member {i}: {text}" for i, text in enumerate(calls))
    raise CollectiveOrderError(f"ranks issued different collectives at the same point: {listing}")
