"""``zeropp plan``: each variant's training step simulated on the user's hardware, and the
one to choose.

    zeropp plan --model small --tokens-per-rank 256 --nodes 2 --ranks-per-node 2 \
                --inter-node-mbit 200 --rank-gflops 5
    zeropp plan --hardware h100-8gpu --layers 32 --hidden 4096 --nodes 4 --ranks-per-node 8
    zeropp plan --schedule runs/schedule.json --hardware a100-8gpu   # a recorded step elsewhere
    zeropp plan --accumulation 8        # 8 micro-steps per optimizer step, node accumulation
    zeropp plan --paper                 # the ZeRO++ paper's cluster beside its published figures
    zeropp plan --compare runs/bench/throughput/throughput.json   # the analytic model vs emulated runs

The step is simulated by :mod:`zeropp.simulate` from the schedule the engine issues (a dry
run records it: :mod:`zeropp_tools.simulation.planner`). The analytic model below
(:mod:`zeropp.auto.step_model`: compute plus the communication compute cannot hide) is
what auto mode still ranks untried candidates by, and ``--compare`` holds it against the
emulated cluster's runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from dataclasses import dataclass, replace

import torch

from zeropp.accounting import FlatSummary
from zeropp.auto.step_model import OVERLAP, Accumulation, LinkSpeeds, link_time, step_seconds
from zeropp.config import ZeroConfig, standard_variants
from zeropp.models import GPT, Block, GPTConfig
from zeropp.sharding import ParamInfo, plan_units
from zeropp.sharding.flat_param import make_slots, shard_numel_for
from zeropp.topology import Layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterModel:
    """A cluster as the planner models it: node count, size and link (the emulated one is
    zeropp_tools.cluster)."""

    num_nodes: int
    ranks_per_node: int
    inter_node_bytes_per_s: float  # one node's link, each direction
    latency_s: float = 50e-6  # per step of a ring or all-to-all (each of the G - 1 exchanges)
    backend: str = "gloo"  # "nccl": plain reduce-scatter is a ring


@dataclass(frozen=True)
class Work:
    flats: tuple[tuple[bool, bool, tuple[int, ...]], ...]  # (is_root, requires_grad, parameter sizes)
    num_parameters: int
    tokens_per_rank: int  # per micro-step
    flops_per_s: float  # achieved by one rank on this model
    overlap: float = OVERLAP
    accumulation: int = 1  # micro-steps per optimizer step (node accumulation when > 1)


def gpt_work(model_size: str, tokens_per_rank: int, flops_per_s: float, **overrides) -> Work:
    """The example GPT's real flat buffers, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(GPTConfig.preset(model_size, **overrides))
    flats = tuple((index == 0, True, tuple(p.param.numel() for p in spec.params))
                  for index, spec in enumerate(plan_units(model, (Block,))) if spec.params)
    return Work(flats, sum(sum(sizes) for _, _, sizes in flats), tokens_per_rank, flops_per_s)


def synthetic_work(num_layers: int, hidden: int, vocab: int, tokens_per_rank: int, flops_per_s: float) -> Work:
    """A transformer of ``num_layers`` blocks of 12 h^2 parameters plus an h x vocab embedding."""
    blocks = tuple((False, True, (12 * hidden * hidden,)) for _ in range(num_layers))
    flats = ((True, True, (vocab * hidden,)), *blocks)
    return Work(flats, sum(sum(sizes) for _, _, sizes in flats), tokens_per_rank, flops_per_s)


def _extent(sizes: tuple[int, ...], alignment: int) -> int:
    """Length of a flat buffer of parameters of these sizes, placed as the engine places them."""
    with torch.device("meta"):
        params = [ParamInfo(torch.nn.Parameter(torch.empty(size)), [], []) for size in sizes]
    last = make_slots(params, alignment)[-1]
    return last.offset + last.numel


def predict(work: Work, cluster: ClusterModel, config: ZeroConfig) -> dict:
    layout = Layout(cluster.num_nodes * cluster.ranks_per_node, cluster.ranks_per_node)
    summaries = [
        FlatSummary(is_root, grad, shard_numel_for(
            _extent(sizes, config.parameter_alignment), layout.world_size, config.effective_shard_alignment))
        for is_root, grad, sizes in work.flats
    ]
    links = LinkSpeeds(cluster.inter_node_bytes_per_s, latency_s=cluster.latency_s)
    accumulation = Accumulation(work.accumulation, node_accumulation=work.accumulation > 1)
    link = link_time(summaries, layout, config, links, cluster.backend, accumulation)
    tokens = work.tokens_per_rank * work.accumulation  # per rank and optimizer step
    compute = 6 * work.num_parameters * tokens / work.flops_per_s
    step = step_seconds(compute, link.seconds, len(work.flats), work.overlap)
    return {"step_s": step, "compute_s": compute, "link_s": link.seconds, "exposed_s": step - compute,
            "inter_node_bytes_per_step": link.inter_node_bytes, "tokens_per_s": tokens * layout.world_size / step}


def recommend(work: Work, cluster: ClusterModel) -> tuple[str, dict]:
    """The fastest variant for this work and cluster, with every variant's prediction."""
    predictions = {name: predict(work, cluster, config) for name, config in standard_variants(cluster.ranks_per_node).items()}
    return min(predictions, key=lambda name: predictions[name]["step_s"]), predictions


def compare(report: dict) -> list[dict]:
    """The planner against ``zeropp bench throughput`` measurements on the emulated cluster.

    Each variant's compute time is calibrated once, from its own unshaped run (there the
    link is not what limits the step); every shaped run is then predicted from the analytic
    bytes and the link's bandwidth alone, and compared with its measured median step."""
    arguments = dict(zip(report["train_arguments"][::2], report["train_arguments"][1::2]))
    nodes, ranks_per_node = (int(n) for n in report["layout"].split("x"))
    tokens = int(arguments["--batch-per-rank"]) * int(arguments["--seq-len"])
    work = gpt_work(arguments["--model"], tokens, 1.0)
    unshaped = report["results"].get("none", {})
    rows = []
    for bandwidth, results in report["results"].items():
        if bandwidth == "none":
            continue
        cluster = ClusterModel(nodes, ranks_per_node, float(bandwidth) * 1e6 / 8)
        for name, config in standard_variants(ranks_per_node).items():
            if "median_step_s" not in results.get(name, {}) or "median_step_s" not in unshaped.get(name, {}):
                continue
            compute = unshaped[name]["median_step_s"]
            calibrated = replace(work, flops_per_s=6 * work.num_parameters * tokens / compute)
            predicted = predict(calibrated, cluster, config)["step_s"]
            measured = results[name]["median_step_s"]
            rows.append({"bandwidth_mbit": float(bandwidth), "variant": name, "measured_step_s": measured,
                         "predicted_step_s": predicted, "error_percent": (predicted - measured) / measured * 100})
    return rows


def comparison_markdown(rows: list[dict]) -> str:
    if not rows:
        return "planner: no variant was measured both unshaped and shaped"
    lines = ["| Mbit/s | variant | measured step (ms) | planner (ms) | error |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['bandwidth_mbit']:g} | {row['variant']} | {row['measured_step_s'] * 1e3:.1f} | "
                     f"{row['predicted_step_s'] * 1e3:.1f} | {row['error_percent']:+.1f}% |")
    worst = max(abs(row["error_percent"]) for row in rows)
    lines.append(f"\nplanner vs measured: largest error {worst:.1f}% over {len(rows)} shaped runs")
    return "\n".join(lines)


def _peak_memory(args, variant: str) -> int:
    """The memory model's peak for ``variant`` (the engine built on the meta device)."""
    from zeropp_tools.dryrun import predicted_memory_of

    from zeropp_tools.simulation.planner import plan_config, plan_gpt

    config = plan_config(args, standard_variants(args.ranks_per_node)[variant])

    phases = predicted_memory_of(plan_gpt(args), args.nodes, args.ranks_per_node, config,
                                 node_accumulation=args.accumulation > 1)
    return max(phases[phase]["total"] for phase in ("forward", "backward", "optimizer_step"))


def main(args) -> int:
    if args.no_prefetch and not args.paper:
        raise ValueError("--no-prefetch applies to --paper only: add --paper, or leave --no-prefetch out")
    if args.keep_weights_between_micro_steps and (args.paper or args.compare or args.schedule):
        raise ValueError("--keep-weights-between-micro-steps applies to the variants' own schedules only: leave "
                         "it out with --paper, --compare and --schedule (a recorded schedule replays as it ran)")
    if args.keep_weights_between_micro_steps and args.accumulation == 1:
        raise ValueError("--keep-weights-between-micro-steps keeps weights between the micro-steps of an "
                         "accumulation: give --accumulation 2 or more, or leave it out")
    if args.compare:
        with open(args.compare) as file:
            rows = compare(json.load(file))
        if not rows:
            raise ValueError(f"--compare: {args.compare} has no variant measured both unshaped and shaped")
        logger.info(comparison_markdown(rows))
        return 0
    if args.paper:
        from zeropp_tools.bench.provenance import provenance
        from zeropp_tools.simulation.paper import paper_markdown, paper_report, paper_summary

        source = provenance()  # before anything is written
        command = "zeropp plan --paper" + (" --no-prefetch" if args.no_prefetch else "")
        report = {"command": command, "provenance": source, **paper_report(prefetch=not args.no_prefetch)}
        report["summary"] = paper_summary(report)
        logger.info(paper_markdown(report))
        logger.info(json.dumps(report["summary"]))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    from zeropp_tools.simulation.planner import (
        describe, plan_hardware, simulate_all, tokens_per_step, variant_schedules,
    )
    from zeropp.simulate.schedule import Schedule

    hardware = plan_hardware(args)
    if args.schedule:
        schedule = Schedule.load(args.schedule)
        step = simulate_all({"recorded": schedule}, hardware)["recorded"]
        logger.info(describe(args.schedule, step, tokens_per_step(schedule, 1)))
        return 0
    steps = simulate_all(variant_schedules(args), hardware)
    tokens = args.tokens_per_rank * args.nodes * args.ranks_per_node * args.accumulation
    for name, step in steps.items():
        logger.info(describe(name, step, tokens) + f"  memory per rank {_peak_memory(args, name) / 1e6:,.1f} MB")
    best = min(steps, key=lambda name: steps[name].step_s)
    logger.info(f"hardware: {hardware.name}")
    logger.info("memory per rank: the memory model's peak over the phases of a step, AdamW, activations not included"
                + (", node accumulation's sums included" if args.accumulation > 1 else ""))
    logger.info(f"per optimizer step of {args.accumulation} micro-step(s) of {args.tokens_per_rank} tokens per rank"
                + (", every unit kept gathered between them" if args.keep_weights_between_micro_steps else ""))
    logger.info(f"recommended: {best}")
    return 0
