"""zeropp vs PyTorch FSDP2 (``fully_shard``), side by side in the same processes.

    .venv/bin/python benchmarks/bench_fsdp2.py            # writes benchmarks/results/fsdp2.json

Four CPU ranks (2 nodes x 2 for zeropp's accounting), the example GPT, fp32 and bf16. Both
systems are built from the same initial weights in every rank process, and their steps
alternate (zeropp, FSDP2, zeropp, ...) so machine noise hits both alike. Reported per
system: median step time, bytes per step (every c10d collective issued, counted per rank
as the bytes a real ring collective moves: (W-1)/W of the buffer for all-gather and
reduce-scatter, 2(W-1)/W for all-reduce), parameters+gradients+optimizer state at rest
(bytes of live storages) and the peak resident-memory increase during a step (VmHWM after
resetting it through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.config import parse_dtype
from zeropp.launch import spawn_ranks
from zeropp.memory import optimizer_state_tensors, peak_rss_increase, resting_bytes_sharded, storage_bytes
from zeropp.models import GPT, Block, GPTConfig
from zeropp_tools.bench.provenance import provenance

RESULTS = Path(__file__).parent / "results"


class CollectiveBytes(TorchDispatchMode):
    """Counts bytes of every c10d collective dispatched while active (one rank's view)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if "c10d" in str(func.namespace if hasattr(func, "namespace") else func):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            largest = max((t.numel() * t.element_size() for t in tensors), default=0)
            share = (self.world_size - 1) / self.world_size
            factor = 2 * share if "allreduce" in name else share
            self.bytes += round(largest * factor)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step(model, optimizer, inputs, targets) -> None:
    model(inputs, targets).backward()
    optimizer.step()
    optimizer.zero_grad()


def _measured_step(model, optimizer, inputs, targets) -> tuple[float, int]:
    started = time.perf_counter()
    _, peak = peak_rss_increase(lambda: _step(model, optimizer, inputs, targets))
    return time.perf_counter() - started, peak


def _build_systems(config, dtype, rank, world_size):
    torch.manual_seed(0)
    reference = GPT(config)
    zeropp_model = ShardedModel(
        copy.deepcopy(reference), Topology.from_environment(ranks_per_node=2), ZeroConfig(compute_dtype=dtype), unit_classes=(Block,)
    )
    zeropp_optimizer = ShardedOptimizer(zeropp_model, lambda p: torch.optim.AdamW(p, lr=1e-3))
    fsdp_model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=parse_dtype("dtype", dtype))
    for block in fsdp_model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(fsdp_model, mesh=mesh, mp_policy=policy)
    fsdp_optimizer = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-3)
    return {"zeropp": (zeropp_model, zeropp_optimizer), "fsdp2": (fsdp_model, fsdp_optimizer)}


def _resting_bytes(name, model, optimizer) -> int:
    if name == "zeropp":
        return resting_bytes_sharded(model, optimizer)
    params = [p.to_local() for p in model.parameters()]
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    states = [t.to_local() if hasattr(t, "to_local") else t for t in optimizer_state_tensors(optimizer)]
    return storage_bytes(params + grads + states)


def run_rank(rank, world_size, args):
    config = GPTConfig.preset(args.model, block_size=args.seq_len)
    systems = _build_systems(config, args.dtype, rank, world_size)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (args.batch_per_rank, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    results = {name: {"step_s": [], "step_peak_bytes": []} for name in systems}
    for name, (model, optimizer) in systems.items():
        for _ in range(args.warmup):
            _step(model, optimizer, inputs, targets)
        counter = CollectiveBytes(world_size)
        if name == "zeropp":
            model.comm_log.reset()
            _step(model, optimizer, inputs, targets)
            results[name]["bytes_per_step"] = model.comm_log.totals()["received"]
        else:
            with counter:
                _step(model, optimizer, inputs, targets)
            results[name]["bytes_per_step"] = counter.bytes
            results[name]["collectives"] = counter.ops
        results[name]["resting_bytes"] = _resting_bytes(name, model, optimizer)
    for _ in range(args.steps):
        for name, (model, optimizer) in systems.items():  # alternate: noise hits both alike
            elapsed, peak = _measured_step(model, optimizer, inputs, targets)
            results[name]["step_s"].append(elapsed)
            results[name]["step_peak_bytes"].append(peak)
    return results


def summarize(per_rank: list[dict], args) -> dict:
    summary = {}
    for name in per_rank[0]:
        # A step ends when the slowest rank ends: take the max over ranks, then the median.
        steps = [max(rank[name]["step_s"][i] for rank in per_rank) for i in range(args.steps)]
        summary[name] = {
            "median_step_s": statistics.median(steps),
            "tokens_per_s": args.batch_per_rank * args.seq_len * len(per_rank) / statistics.median(steps),
            "bytes_per_step_per_rank": per_rank[0][name]["bytes_per_step"],
            "resting_bytes_per_rank": per_rank[0][name]["resting_bytes"],
            "peak_step_rss_increase_bytes": max(max(rank[name]["step_peak_bytes"]) for rank in per_rank),
        }
        if "collectives" in per_rank[0][name]:
            summary[name]["collectives_per_step"] = per_rank[0][name]["collectives"]
    summary["throughput_ratio_zeropp_over_fsdp2"] = summary["fsdp2"]["median_step_s"] / summary["zeropp"]["median_step_s"]
    summary["bytes_ratio_zeropp_over_fsdp2"] = (
        summary["zeropp"]["bytes_per_step_per_rank"] / summary["fsdp2"]["bytes_per_step_per_rank"]
    )
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--out", default=str(RESULTS / "fsdp2.json"))
    args = parser.parse_args(argv)
    report = {"date": datetime.now(timezone.utc).isoformat(), "provenance": provenance(), "world_size": 4,
              "layout": "2 nodes x 2 ranks (CPU, gloo)", "config": vars(args), "results": {}}
    print(json.dumps(report["config"]))
    for dtype in args.dtypes.split(","):
        run_args = argparse.Namespace(**{**vars(args), "dtype": dtype})
        summary = summarize(spawn_ranks(run_rank, 4, (run_args,)), run_args)
        report["results"][dtype] = summary
        print(f"{dtype}: zeropp/FSDP2 throughput {summary['throughput_ratio_zeropp_over_fsdp2']:.3f}x, "
              f"bytes {summary['bytes_ratio_zeropp_over_fsdp2']:.3f}x; "
              + "; ".join(f"{n}: {summary[n]['median_step_s'] * 1e3:.1f} ms/step, "
                          f"{summary[n]['bytes_per_step_per_rank'] / 1e6:.2f} MB/step, "
                          f"rest {summary[n]['resting_bytes_per_rank'] / 1e6:.2f} MB, "
                          f"step peak +{summary[n]['peak_step_rss_increase_bytes'] / 1e6:.1f} MB" for n in ("zeropp", "fsdp2")))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
