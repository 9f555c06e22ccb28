"""Measuring the bytes a rank holds at rest (between steps), by walking real storages."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterable
from pathlib import Path

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def resting_bytes_replicated(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients and the optimizer state of an unsharded model."""
    tensors = list(model.parameters())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    return storage_bytes(tensors + optimizer_state_tensors(optimizer))


def resting_bytes_sharded(model, optimizer) -> int:
    """The same for a :class:`zeropp.ShardedModel` and its :class:`zeropp.ShardedOptimizer`,
    including compute-dtype shard copies, any gathered buffer still allocated and what the
    weight gather keeps (hpZ parts, quantized caches, the delta gather's copies)."""
    tensors = []
    for flat in model.flat_params():
        tensors.append(flat.master)
        if flat.master.grad is not None:
            tensors.append(flat.master.grad)
        tensors.append(flat.compute_shard())
        tensors.append(flat.full)
    tensors += model.weight_gather.kept_tensors()
    return storage_bytes(tensors + optimizer_state_tensors(optimizer.optimizer))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident set now (Linux VmRSS)."""
    return _status_kib("VmRSS") * 1024


def peak_resident_bytes() -> int:
    """The most this process has held resident (Linux VmHWM, since start or the last reset)."""
    return _status_kib("VmHWM") * 1024


def peak_rss_increase(fn):
    """Run ``fn()``; return its result and the peak resident-set growth in bytes while it ran
    (Linux: VmHWM is reset through /proc/self/clear_refs before the call)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status_kib("VmRSS")
    result = fn()
    return result, (_status_kib("VmHWM") - before) * 1024


def process_resources() -> dict[str, int]:
    """This process's resident memory (bytes), open file descriptors and threads (Linux)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "open_files": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
    }


@functools.cache
def _c_library():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def trimmed_rss_bytes() -> int:
    """This process's resident memory after handing the allocator's free pages back to the
    system (glibc's ``malloc_trim(0)``; elsewhere plain RSS): what live objects hold, not
    freed blocks glibc keeps for reuse. For measuring memory released, outside timed code:
    the next allocations fault their pages in again."""
    library = _c_library()
    if library is not None and hasattr(library, "malloc_trim"):
        library.malloc_trim(0)
    return process_resources()["rss_bytes"]
