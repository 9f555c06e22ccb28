"""Error of qgZ's gradient schemes on the GPT's real gradients, against the exact mean.

Every rank of a 2 nodes x 2 layout computes the gradient of the same GPT (trained a few
steps, so gradients are realistic) on its own batches, for several consecutive steps. Each
scheme reduce-scatters them; we compare with the exact fp64 mean:

- ``step``: relative L2 error of one step's result, averaged over steps;
- ``cumulative``: relative L2 error of the sum over all steps, what plain SGD integrates
  (error feedback is built to shrink this one);
- ``adam``: relative L2 error of the sum of Adam's updates (the training loop's AdamW
  moments, fed the scheme's results instead of the exact ones), what our optimizer
  integrates: Adam divides by each value's own scale, so an error on a small gradient
  counts as much as one on a large gradient;
- ``inter_node_bytes_per_value``: what the scheme sends across nodes per gradient value.

    zeropp bench grad-error --out runs/bench/gradient_error.json
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from zeropp.accounting import CommLog
from zeropp.collectives import Communicator
from zeropp.collectives.reference import reference_reduce_scatter_mean
from zeropp.data import ByteCorpus, load_stdlib_corpus
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, GPTConfig
from zeropp.config import ZeroConfig
from zeropp.reduce import select_gradient_reduction
from zeropp.topology import Layout, Topology
from zeropp_tools.bench.provenance import provenance

logger = logging.getLogger(__name__)


BLOCK = 256
METRICS = ("step", "cumulative", "adam")
# Each scheme is a qgZ config (overrides of BASE); the selector builds its reduction, so a
# scheme added to the library shows up here as one more row.
BASE = dict(quantized_gradients=True, quantization_block_size=BLOCK, gradient_chunks=2)
SCHEMES = {
    "int4/int4 (ZeRO++)": dict(),
    "int4/int4 + hadamard32": dict(gradient_hadamard=32),
    "int4/int4 + stochastic": dict(gradient_stochastic_rounding=True),
    "int4/int4 + error feedback": dict(gradient_error_feedback=True),
    "int8/int4": dict(gradient_bits_intra_node=8),
    "int8/int4 + stochastic": dict(gradient_bits_intra_node=8, gradient_stochastic_rounding=True),
    "int8/int4 + error feedback": dict(gradient_bits_intra_node=8, gradient_error_feedback=True),
    "int8/int4 + error feedback + stochastic": dict(gradient_bits_intra_node=8, gradient_error_feedback=True,
                                                    gradient_stochastic_rounding=True),
    "int8/int4 + hadamard32 + error feedback": dict(gradient_bits_intra_node=8, gradient_hadamard=32,
                                                    gradient_error_feedback=True),
    # 4 bits across nodes on powers of two (``gradient_grid_inter_node="log"``).
    "int4/log4": dict(gradient_grid_inter_node="log"),
    "int8/log4": dict(gradient_bits_intra_node=8, gradient_grid_inter_node="log"),
    "int8/log4 + error feedback": dict(gradient_bits_intra_node=8, gradient_grid_inter_node="log",
                                       gradient_error_feedback=True),
    # bf16 scales on 128-value blocks: the bytes of 256-value blocks with fp32 scales.
    "int4/int4, 128 blocks, bf16 scales": dict(quantization_block_size=128, gradient_scale_dtype="bf16"),
    "int8/log4, 128 blocks, bf16 scales": dict(gradient_bits_intra_node=8, gradient_grid_inter_node="log",
                                               quantization_block_size=128, gradient_scale_dtype="bf16"),
    # Twice the inter-node gradient bytes: how close 8 bits across nodes would come.
    "int8/int8": dict(gradient_bits_intra_node=8, gradient_bits_inter_node=8),
}


def scheme_config(name: str) -> ZeroConfig:
    return ZeroConfig(**{**BASE, **SCHEMES[name]})


def _gradients(rank: int, world_size: int, steps: int) -> list[torch.Tensor]:
    """``steps`` flat gradients of this rank, padded to whole blocks per rank and chunk."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = ByteCorpus(load_stdlib_corpus(max_bytes=4_000_000))
    for step in range(20):  # the same warm-up everywhere: every rank holds the same model
        inputs, targets = corpus.global_batch("train", step, 8, 128)
        optimizer.zero_grad()
        model(inputs, targets).backward()
        optimizer.step()
    flats = []
    for step in range(steps):
        inputs, targets = corpus.rank_batch("train", 100 + step, 8, 128, rank, world_size)
        model.zero_grad()
        model(inputs, targets).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        multiple = world_size * BLOCK * 2
        flats.append(torch.nn.functional.pad(flat, (0, -flat.numel() % multiple)))
    return flats


class _AdamUpdates:
    """Adam's update direction (``torch.optim.AdamW``'s defaults, no learning rate or decay)
    and the sum of it over the steps seen."""

    def __init__(self, like: torch.Tensor, betas=(0.9, 0.999), eps=1e-8) -> None:
        self.betas, self.eps, self.step = betas, eps, 0
        self.first, self.second, self.total = (torch.zeros_like(like, dtype=torch.float64) for _ in range(3))

    def add(self, gradient: torch.Tensor) -> None:
        self.step += 1
        beta1, beta2 = self.betas
        gradient = gradient.double()
        self.first.mul_(beta1).add_(gradient, alpha=1 - beta1)
        self.second.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        first = self.first / (1 - beta1**self.step)
        second = self.second / (1 - beta2**self.step)
        self.total += first / (second.sqrt() + self.eps)


def _measure(rank: int, world_size: int, steps: int) -> dict:
    topology = Topology.from_environment(ranks_per_node=2)
    communicator = Communicator(CommLog(topology.layout, rank))
    gradients = _gradients(rank, world_size, steps)
    exact = [reference_reduce_scatter_mean(g, topology.group("world"), rank) for g in gradients]
    results = {}
    for name in SCHEMES:
        reduction = select_gradient_reduction(scheme_config(name), topology, communicator)
        step_errors, error_sum, exact_sum = [], torch.zeros_like(exact[0]), torch.zeros_like(exact[0])
        adam, exact_adam = _AdamUpdates(exact[0]), _AdamUpdates(exact[0])
        for gradient, truth in zip(gradients, exact):
            result = reduction.start(gradient, "grad").wait()
            step_errors.append(((result - truth).norm() / truth.norm()).item())
            error_sum += result - truth
            exact_sum += truth
            adam.add(result)
            exact_adam.add(truth)
        results[name] = {
            "step": sum(step_errors) / len(step_errors),
            "cumulative": (error_sum.norm() / exact_sum.norm()).item(),
            "adam": ((adam.total - exact_adam.total).norm() / exact_adam.total.norm()).item(),
        }
    return results


def run(steps: int = 32) -> dict:
    per_rank = spawn_ranks(_measure, 4, (steps,))
    merged = {}
    for name in SCHEMES:  # average the per-rank relative errors
        merged[name] = {key: sum(r[name][key] for r in per_rank) / len(per_rank) for key in METRICS}
    baseline = merged["int4/int4 (ZeRO++)"]
    for name, row in merged.items():
        for key in METRICS:
            row[f"{key}_vs_zeropp"] = baseline[key] / row[key]
        row["inter_node_bytes_per_value"] = _inter_node_bytes_per_value(scheme_config(name))
    return {"layout": "2x2", "block_size": BLOCK, "steps": steps, "schemes": merged}


def _inter_node_bytes_per_value(config: ZeroConfig) -> float:
    """What one rank of 2 nodes x 2 receives across nodes per gradient value it reduces."""
    shard = 64 * BLOCK
    received = select_gradient_reduction(config).predicted_bytes(shard, Layout(4, 2), rank=0)
    return received.inter_node / shard


def main(args) -> int:
    report = run(args.steps)
    logger.info(f"{'scheme':<42}" + "".join(f"{key:>12}{'vs ZeRO++':>11}" for key in METRICS) + f"{'bytes/value':>13}")
    for name, row in report["schemes"].items():
        figures = "".join(f"{row[key]:>12.4f}{row[key + '_vs_zeropp']:>10.2f}x" for key in METRICS)
        logger.info(f"{name:<42}{figures}{row['inter_node_bytes_per_value']:>13.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report["provenance"] = provenance()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info(f"wrote {args.out}")
    return 0
