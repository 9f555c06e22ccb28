"""CPU seconds per training step per rank, by zeropp variant: where the quantizers' work
goes when the network is free.

    .venv/bin/python benchmarks/cpu_per_step.py                 # writes benchmarks/results/cpu_per_step.json
    .venv/bin/python benchmarks/cpu_per_step.py --variants zero3,qgz

Four CPU ranks on one machine (2 nodes x 2 for the topology, loopback gloo), the medium
GPT, 4 x 64 tokens per rank. Unshaped, every rank's step is bound by the CPU, so the extra
CPU time a variant spends per step (user + system, gloo's threads included) is what it
costs in throughput; wall time alone mixes it with waiting for the other ranks. The
variants run one after another, each in fresh processes, after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import time
from pathlib import Path

import torch

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp_tools.bench.provenance import chosen_precision, provenance

logger = logging.getLogger("cpu_per_step")

ZEROPP_PLUS_PLUS = dict(quantized_weights=True, hpz_size=2, quantized_gradients=True)
VARIANTS = {
    "zero3": {},
    "qwz": dict(quantized_weights=True),
    "hpz": dict(hpz_size=2),
    "qgz": dict(quantized_gradients=True),
    "zero++": ZEROPP_PLUS_PLUS,
    "qgz+compiled": dict(quantized_gradients=True, compile_quantization=True),
    "zero+++compiled": dict(ZEROPP_PLUS_PLUS, compile_quantization=True),
}


def measure(rank: int, world_size: int, options: dict, precision: str, steps: int) -> dict:
    topology = Topology.from_environment(ranks_per_node=2)
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("medium")), topology, ZeroConfig(compute_dtype=precision, **options),
                         unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-4))
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # warm-up (and, compiled, the compiles)
        step()
    before, walls = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        walls.append(time.perf_counter() - started)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": statistics.median(walls), "user_s": (after.ru_utime - before.ru_utime) / steps,
            "system_s": (after.ru_stime - before.ru_stime) / steps}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--precision", default="auto", help="auto (bf16 where native), bf16 or fp32")
    parser.add_argument("--out", default="benchmarks/results/cpu_per_step.json")
    arguments = parser.parse_args()
    variants = arguments.variants.split(",")
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed values: {list(VARIANTS)}")
    precision, why = chosen_precision(arguments.precision)
    results = {}
    for name in variants:
        per_rank = spawn_ranks(measure, 4, (VARIANTS[name], precision, arguments.steps))
        results[name] = {"wall_s_rank0": per_rank[0]["wall_s"],
                         "cpu_s_per_rank": statistics.fmean(r["user_s"] + r["system_s"] for r in per_rank),
                         "per_rank": per_rank}
        logger.info("%-16s step %.3f s wall (rank 0), %.3f CPU-s per rank", name, results[name]["wall_s_rank0"],
                    results[name]["cpu_s_per_rank"])
    report = {"provenance": provenance(), "precision": {"compute_dtype": precision, "why": why},
              "model": "medium", "tokens_per_rank": [4, 64], "layout": "2x2 (loopback)", "results": results}
    Path(arguments.out).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", arguments.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
