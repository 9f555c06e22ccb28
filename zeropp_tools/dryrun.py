"""``zeropp dryrun``: real training steps of the engine as one rank of a large world, on
no accelerator at all.

    zeropp dryrun                                   # the paper's 18B model, 384 ranks as 24 x 16
    zeropp dryrun --layers 80 --hidden 12288 --nodes 48 --ranks-per-node 8

The process joins a fake process group (``init_process_group("fake")``: rank r of W,
collectives return at once) and runs the engine on the meta device, which stands in for
the GPU: tensors have shapes, dtypes and a device but no storage, and any tensor created
on the CPU and mixed with them raises, as a CPU/CUDA mix would on a GPU. A CPU-only torch
cannot do the same with fake CUDA tensors: its autograd needs the CUDA device guard, which
only a CUDA build links. ``.item()`` and copies to the CPU are counted as the host
synchronisations they would be on a GPU, with the line that made them.

Reported per rank: peak bytes per phase from the live-tensor tracker (meta tensors counted
at their size) beside the memory model's prediction, bytes per phase from the accounting,
and the host synchronisations of a training step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.init.base import WeightSource
from zeropp.memory_tracker import LiveTensorTracker
from zeropp.models import GPT, Block, GPTConfig
from zeropp.simulate.schedule import Schedule

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEVICE_MEMORY = {"V100 32 GB": 32 * GIB, "A100/H100 80 GB": 80 * GIB}
VARIANTS = {
    "zero3": ZeroConfig(compute_dtype="fp16", reduce_dtype="fp16"),
    "zero++": ZeroConfig(compute_dtype="fp16", reduce_dtype="fp16", quantized_weights=True, hpz_size=16,
                         quantized_gradients=True),
}


@dataclass(frozen=True)
class DryRun:
    layers: int = 40
    hidden: int = 6144
    vocabulary: int = 50_000
    nodes: int = 24
    ranks_per_node: int = 16
    rank: int = 0
    tokens_per_rank: int = 1024  # one sequence of 1K tokens per GPU, as the paper's 1K runs
    variant: str = "zero3"
    activation_checkpointing: bool = True

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


class NoWeights(WeightSource):
    """Shards without values, on the meta device: the dry run needs shapes only."""

    def prepare_unit(self, index: int, modules: list[nn.Module], params) -> None:
        pass

    def shard(self, params, slots, start: int, shard_numel: int) -> torch.Tensor:
        return torch.empty(shard_numel, dtype=torch.float32, device=self.device)


def config_for(run: DryRun) -> ZeroConfig:
    config = VARIANTS[run.variant]
    if config.hpz_size > 1:
        config = replace(config, hpz_size=run.ranks_per_node)
    return replace(config, activation_checkpointing=run.activation_checkpointing)


def dry_run(run: DryRun, steps: int = 2) -> dict:
    """Collective on the fake process group this process must have joined as ``run.rank``."""
    tracker = LiveTensorTracker(dry_run=True)
    with tracker:
        model, tokens = dry_model(run)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        for step in range(steps):  # the last step is the one reported: caches and copies exist
            tracker.reset_peaks()
            tracker.host_syncs.clear()
            model.comm_log.reset()
            tracker.training_step(lambda: model(tokens[:, :-1], tokens[:, 1:]), optimizer)
    predicted = model.predicted_memory(activation_bytes=0)
    measured = {phase: tracker.phase_peak_total(phase) for phase in ("forward", "backward", "optimizer_step")}
    measured["resting"] = tracker.current_total()
    return {
        "run": run.__dict__, "parameters": sum(flat.numel for flat in model.flat_params()),
        "measured_bytes": measured, "predicted_bytes": {phase: value["total"] for phase, value in predicted.items()},
        "peak_bytes": max(measured.values()),
        "comm_bytes": model.comm_log.totals_by_phase(), "host_syncs": dict(tracker.host_syncs),
        "fits": {device: max(measured.values()) <= size for device, size in DEVICE_MEMORY.items()},
    }


def dry_run_schedule(run: DryRun, config: ZeroConfig | None = None, steps: int = 2, micro_steps: int = 1) -> Schedule:
    """The schedule rank ``run.rank`` issues in one training step of ``run`` (the last of
    ``steps``: the first learns the prefetch order), recorded from the engine on the fake
    process group this process must have joined. ``config`` overrides the variant's. With
    ``micro_steps`` > 1 the step accumulates, the micro-steps before the last under
    ``no_sync`` (node accumulation), as ``zeropp train --accumulation`` runs them."""
    model, tokens = dry_model(run, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    with model.record_schedule() as recorder:
        for _ in range(steps):
            recorder.reset()
            model.comm_log.reset()
            for micro in range(micro_steps):
                model.set_requires_gradient_sync(micro == micro_steps - 1)
                model(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
    schedule = recorder.schedule
    schedule.tokens_per_rank = run.tokens_per_rank
    schedule.optimizer_parameters = sum(parameter.numel() for parameter in model.parameters())
    return schedule


def dry_model(run: DryRun, config: ZeroConfig | None = None) -> tuple[ShardedModel, torch.Tensor]:
    """The engine over the built-in GPT of ``run``'s shape on the meta device, and a batch
    of one sequence (inputs and targets: ``tokens_per_rank + 1`` positions)."""
    topology = Topology.from_environment(ranks_per_node=run.ranks_per_node, device="meta")
    gpt = GPTConfig(vocab_size=run.vocabulary, block_size=run.tokens_per_rank, num_layers=run.layers,
                    num_heads=max(1, run.hidden // 128), embed_dim=run.hidden)
    with torch.device("meta"):
        module = GPT(gpt)
    model = ShardedModel(module, topology, config or config_for(run), unit_classes=(Block,), init=NoWeights())
    return model, torch.randint(0, run.vocabulary, (1, run.tokens_per_rank + 1), device="meta")


def predicted_memory_of(gpt: GPTConfig, nodes: int, ranks_per_node: int, config: ZeroConfig,
                        node_accumulation: bool = False) -> dict:
    """The memory model for the built-in GPT ``gpt`` on rank 0 of ``nodes`` x
    ``ranks_per_node`` under ``config``: the engine is built (not run) on the meta device
    in a fake world, so its real flat buffers and strategies are what is counted."""
    join_fake_world(DryRun(nodes=nodes, ranks_per_node=ranks_per_node))
    try:
        topology = Topology.from_environment(ranks_per_node=ranks_per_node, device="meta")
        with torch.device("meta"):
            module = GPT(gpt)
        model = ShardedModel(module, topology, config, unit_classes=(Block,), init=NoWeights())
        return model.predicted_memory(node_accumulation=node_accumulation)
    finally:
        dist.destroy_process_group()


def join_fake_world(run: DryRun) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=run.rank, world_size=run.world_size)


def _pairs(text: str, flag: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(part) for part in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: give comma-separated AxB pairs, for example 24x16,48x8") from None


def main(args) -> int:
    from zeropp_tools.bench.provenance import provenance

    source = provenance()  # before anything is written
    results = []
    for layers, hidden in _pairs(args.models, "--models"):
        for nodes, per_node in _pairs(args.layouts, "--layouts"):
            for variant in args.variants.split(","):
                if variant not in VARIANTS:
                    raise ValueError(f"--variants: unknown {variant!r}; allowed values: {list(VARIANTS)}")
                run = DryRun(layers=layers, hidden=hidden, nodes=nodes, ranks_per_node=per_node,
                             tokens_per_rank=args.tokens_per_rank, variant=variant,
                             activation_checkpointing=not args.no_activation_checkpointing)
                join_fake_world(run)
                results.append(dry_run(run))
                logger.info(format_result(results[-1]))
    dist.destroy_process_group()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"command": "zeropp dryrun", "arguments": {k: v for k, v in vars(args).items() if k != "func"},
                  "provenance": source, "results": results}
        (out / "dryrun.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "dryrun.md").write_text(markdown(report))
    return 0


def markdown(report: dict) -> str:
    source = report["provenance"]
    lines = [f"# Dry run: per-GPU memory at the paper's scale (commit {source['git_commit']}, torch {source['torch']})",
             "", "Rank 0 of the world, fp16 compute and reduction, AdamW (fp32 masters and moments), activation "
             f"checkpointing, {report['arguments']['tokens_per_rank']} tokens per GPU. Dry run: the live-tensor "
             "tracker's peak over the step (activations included). Model: `predicted_memory()` (activations "
             "not included).", "",
             "| model | nodes x GPUs | scheme | dry-run peak | model peak | resting | fits 32 GB V100 | fits 80 GB A100/H100 | host syncs per step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in report["results"]:
        run = result["run"]
        predicted_peak = max(result["predicted_bytes"][phase] for phase in ("forward", "backward", "optimizer_step"))
        fits = result["fits"]
        lines.append(f"| {result['parameters'] / 1e9:.1f}B ({run['layers']} x {run['hidden']}) | "
                     f"{run['nodes']} x {run['ranks_per_node']} | {run['variant']} | {result['peak_bytes'] / GIB:.2f} GiB | "
                     f"{predicted_peak / GIB:.2f} GiB | {result['measured_bytes']['resting'] / GIB:.2f} GiB | "
                     f"{'yes' if fits['V100 32 GB'] else 'no'} | {'yes' if fits['A100/H100 80 GB'] else 'no'} | "
                     f"{sum(result['host_syncs'].values())} |")
    arguments = report["arguments"]
    lines += ["", f"Reproduce: `zeropp dryrun --models {arguments['models']} --layouts {arguments['layouts']} "
                  f"--variants {arguments['variants']} --out <folder>`", ""]
    return "\n".join(lines)


def format_result(result: dict) -> str:
    run = result["run"]
    lines = [f"{run['variant']}: {result['parameters'] / 1e9:.1f}B parameters, rank {run['rank']} of "
             f"{run['nodes']} x {run['ranks_per_node']}, {run['tokens_per_rank']} tokens per rank",
             f"  {'phase':<16}{'dry run GB':>12}{'model GB':>12}"]
    for phase, value in result["measured_bytes"].items():
        lines.append(f"  {phase:<16}{value / GIB:>12.2f}{result['predicted_bytes'][phase] / GIB:>12.2f}")
    lines.append("  fits: " + ", ".join(f"{device} {'yes' if fits else 'no'}" for device, fits in result["fits"].items()))
    syncs = result["host_syncs"]
    lines.append(f"  host synchronisations per step: {sum(syncs.values())}"
                 + "".join(f"\n    {count} x {where}" for where, count in syncs.items()))
    return "\n".join(lines)
