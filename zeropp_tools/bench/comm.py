"""``zeropp bench comm``: bytes per step of ZeRO-3 and each ZeRO++ optimization, measured by
the accounting of real runs and predicted by the analytic model, side by side.

    zeropp bench comm                          # GPT small, layouts 2x2, 2x4, 4x2
    zeropp bench comm --model tiny --layouts 2x2 --out runs/comm.json
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from zeropp.config import standard_variants
from zeropp.engine import ShardedModel
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.optim import ShardedOptimizer
from zeropp.topology import Topology
from zeropp_tools.bench.provenance import provenance

logger = logging.getLogger(__name__)


def measure_variants(rank: int, world_size: int, ranks_per_node: int, model_size: str, tokens: tuple[int, int]):
    """For every variant: measured and predicted bytes of this rank's second step."""
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    batch, seq_len = tokens
    generator = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)
    results = {}
    for name, config in standard_variants(ranks_per_node).items():
        torch.manual_seed(0)
        model = ShardedModel(GPT(GPTConfig.preset(model_size, block_size=seq_len)), topology, config, unit_classes=(Block,))
        optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
        for _ in range(2):  # the first step learns the prefetch order; measure the second
            model.comm_log.reset()
            model(data[:, :-1], data[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = {"measured": _phases(model.comm_log.totals_by_phase()), "predicted": model.predicted_step_bytes()}
    return results


def _phases(totals: dict) -> dict:
    keys = ("received_intra_node", "received_inter_node")
    main = ("forward_gather", "backward_gather", "reduce_scatter")
    return {phase: {key: row[key] for key in keys} for phase, row in totals.items() if phase in main}


def _sum_phases(per_rank: list[dict]) -> dict:
    summed: dict = {}
    for phases in per_rank:
        for phase, row in phases.items():
            target = summed.setdefault(phase, {})
            for key, value in row.items():
                target[key] = target.get(key, 0) + value
    return summed


def step_totals(phases: dict) -> dict[str, int]:
    return {
        "intra_node": sum(row["received_intra_node"] for row in phases.values()),
        "inter_node": sum(row["received_inter_node"] for row in phases.values()),
    }


def run(layouts: list[tuple[int, int]], model_size: str = "small", tokens=(4, 64)) -> dict:
    report = {"model": model_size, "tokens_per_rank": tokens, "dtype": "bf16", "layouts": {}}
    for nodes, per_node in layouts:
        per_rank = spawn_ranks(measure_variants, nodes * per_node, (per_node, model_size, tokens))
        node0 = per_rank[:per_node]  # what node 0's ranks receive is what its link carries in
        rows = {}
        for name in node0[0]:
            phases = {kind: _sum_phases([result[name][kind] for result in node0]) for kind in ("measured", "predicted")}
            rows[name] = {
                "measured": step_totals(phases["measured"]), "predicted": step_totals(phases["predicted"]),
                "phases": phases,
            }
        baseline = rows["zero3"]["measured"]["inter_node"]
        for row in rows.values():
            row["inter_node_vs_zero3"] = row["measured"]["inter_node"] / baseline
        report["layouts"][f"{nodes}x{per_node}"] = rows
    return report


def format_report(report: dict) -> str:
    lines = [f"GPT {report['model']}, bf16, bytes node 0's ranks receive per step (measured | predicted)"]
    for layout, rows in report["layouts"].items():
        lines.append(f"\nlayout {layout} (nodes x ranks per node)")
        lines.append(f"{'variant':<8}{'inter MB':>12}{'predicted':>12}{'intra MB':>12}{'predicted':>12}{'inter vs ZeRO-3':>18}")
        for name, row in rows.items():
            m, p = row["measured"], row["predicted"]
            lines.append(
                f"{name:<8}{m['inter_node'] / 1e6:>12.4f}{p['inter_node'] / 1e6:>12.4f}"
                f"{m['intra_node'] / 1e6:>12.4f}{p['intra_node'] / 1e6:>12.4f}{row['inter_node_vs_zero3']:>17.3f}x"
            )
    return "\n".join(lines)


def parse_layout(text: str) -> tuple[int, int]:
    try:
        nodes, per_node = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {text!r} must look like NODESxRANKS, for example 2x2") from None
    if nodes < 1 or per_node < 1:
        raise ValueError(f"layout {text!r} needs at least one node and one rank per node")
    return nodes, per_node


def main(args) -> int:
    layouts = [parse_layout(text) for text in args.layouts.split(",")]
    report = run(layouts, args.model)
    logger.info(format_report(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report["provenance"] = provenance()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info(f"\nwrote {args.out}")
    return 0
