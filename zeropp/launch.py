"""Starting W local CPU ranks (or joining a torchrun world) and collecting their results.

``spawn_ranks`` is what ``zeropp demo`` and the multi-process tests use: it starts fresh
processes, initialises gloo on a free loopback port, runs ``fn(rank, world_size, *args)``
in each and returns every rank's return value. A rank that raises, dies or outlives
``timeout_s`` makes the whole call fail with an error naming the rank, never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What the fork server imports once, before any rank forks from it. A caller whose ranks
# all import another slow module may add it here before the first spawn (the tests add
# transformers, a few seconds per rank otherwise).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "zeropp"]


def spawn_ranks(
    fn, world_size: int, args: tuple = (), timeout_s: float = 600.0, threads_per_rank: int = 1,
    collective_timeout_s: float = 300.0, backend: str = "gloo", start_method: str = "forkserver",
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks of a ``backend``
    process group (gloo; ``"cpu:gloo,cuda:nccl"`` puts rank r on GPU r); return every rank's
    result (None for a rank that exited without one). ``collective_timeout_s`` is the world
    process group's timeout. Each rank sees the caller's environment; a variable read only
    when a process starts (glibc's ``MALLOC_*``) needs ``start_method="spawn"``."""
    if start_method == "forkserver":
        # The fork server imports torch once; every rank forks from it instead of starting
        # a fresh interpreter (about 2 s of a 4-rank start on 2 cores).
        mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zeropp-ranks-") as folder:
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, args, port, folder, threads_per_rank, collective_timeout_s, backend,
                  dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            _reraise_rank_error(Path(folder), world_size, error)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        paths = [Path(folder) / f"rank{r}.pt" for r in range(world_size)]
        return [torch.load(path, weights_only=False) if path.exists() else None for path in paths]


def _reraise_rank_error(folder: Path, world_size: int, error: Exception) -> None:
    """Raise the exception of the lowest failing rank as itself (so callers can catch a
    ValueError as a ValueError), noting the rank; else the launcher's own error."""
    for rank in range(world_size):
        path = folder / f"rank{rank}.error"
        if path.exists():
            original = pickle.loads(path.read_bytes())
            original.add_note(f"(raised on rank {rank} of {world_size})")
            raise original from None
    raise RuntimeError(f"a rank failed:\n{error}") from None


def _rank_main(rank, fn, world_size, args, port, folder, threads_per_rank, collective_timeout_s, backend,
               environment) -> None:
    # A forked rank starts with the fork server's environment, captured when it started.
    os.environ.clear()
    os.environ.update(environment)
    torch.set_num_threads(threads_per_rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    timeout = timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    exit_code = 0
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        _wait_for_peers()
    except Exception as error:
        exit_code = 1
        traceback.print_exc()
        try:
            (Path(folder) / f"rank{rank}.error").write_bytes(pickle.dumps(error))
        except Exception:  # an exception that does not pickle: the traceback above remains
            pass
    finally:
        dist.destroy_process_group()
    exit_without_finalization(exit_code)


def exit_without_finalization(exit_code: int) -> None:
    """End a rank whose process group is destroyed, skipping interpreter finalization:
    gloo's C++ threads can still hold tensors whose Python owners die there, which aborts
    a rank that has finished its work (SIGABRT, "terminate called without an active
    exception"). Logs, streams and multiprocessing's own clean-up (semaphores) run first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    multiprocessing.util._exit_function()
    os._exit(exit_code)


def finish_distributed() -> None:
    """Leave the world cleanly: wait for every rank, then tear the process group down."""
    _wait_for_peers()
    dist.destroy_process_group()


def _wait_for_peers() -> None:
    """Tear down only when every rank is done: a rank that closes its connections while a
    peer still reads from them makes gloo abort that peer. A peer that is gone already
    (a failure the caller handled) has nothing left to protect."""
    try:
        dist.barrier()
    except RuntimeError:
        pass


def init_from_torchrun(collective_timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the world torchrun describes in the environment: gloo for CPU tensors, and NCCL
    for CUDA tensors when there is a GPU (one device-aware process group)."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s))
    return dist.get_rank(), dist.get_world_size()
