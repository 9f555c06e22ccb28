"""``zeropp bench sweep``: ZeRO++'s speedup over ZeRO-3 against the share of ZeRO-3's step
spent on the network, at one link bandwidth.

    zeropp bench sweep                      # 1 Gbit/s, GPT medium, 1 to 16 sequences per rank

The share is varied through the work per step (sequences per rank): fewer tokens leave the
same bytes per step less compute to hide behind. ZeRO-3's network share is the part of
its step rank 0 spent blocked in collectives. The ZeRO++ paper's fast-cluster claim
(+28-36%) is for ZeRO-3 spending about half its step on the network. Each (batch,
variant) is repeated in rotated order; medians and spreads as in ``zeropp bench
throughput``. Writes sweep.json (with the git commit and the machine), sweep.md, sweep.png.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from zeropp_tools.bench.cells import measure
from zeropp_tools.bench.provenance import chosen_precision, provenance
from zeropp_tools.cluster import ClusterSpec

logger = logging.getLogger(__name__)

BASELINE = "zero3"


def run(arguments, precision: str) -> dict:
    batches = [int(text) for text in arguments.batches.split(",")]
    variants = arguments.variants.split(",")
    spec = ClusterSpec(arguments.nodes, arguments.ranks_per_node, arguments.bandwidth)
    cells = [(batch, variant) for batch in batches for variant in variants]
    runs = {str(batch): {variant: [] for variant in variants} for batch in batches}
    for repetition in range(arguments.repetitions):
        shift = repetition * len(cells) // arguments.repetitions
        for batch, variant in cells[shift:] + cells[:shift]:
            train_arguments = ["--model", arguments.model, "--steps", str(arguments.steps), "--batch-per-rank",
                               str(batch), "--seq-len", str(arguments.seq_len), "--precision", precision]
            measured = measure(spec, variant, train_arguments)
            runs[str(batch)][variant].append(measured)
            logger.info("batch %d %-16s %8.0f tokens/s, exposed comm %.0f%%", batch, variant, measured["tokens_per_s"],
                        100 * measured["exposed_fraction"])
    return {"provenance": provenance(), "bandwidth_mbit": arguments.bandwidth, "model": arguments.model,
            "seq_len": arguments.seq_len, "precision": precision, "repetitions": arguments.repetitions,
            "runs": runs, "points": points(runs)}


def points(runs: dict) -> list[dict]:
    """One point per (batch, variant other than ZeRO-3): ZeRO-3's network share and the
    variant's speedup, medians over the repetitions."""
    result = []
    for batch, row in runs.items():
        zero3 = row[BASELINE]
        share = statistics.median(run["exposed_fraction"] for run in zero3)
        baseline = statistics.median(run["tokens_per_s"] for run in zero3)
        for variant, measured in row.items():
            if variant == BASELINE:
                continue
            speedups = sorted(run["tokens_per_s"] / baseline for run in measured)
            result.append({"batch_per_rank": int(batch), "variant": variant, "zero3_network_share": share,
                           "zero3_network_share_runs": sorted(run["exposed_fraction"] for run in zero3),
                           "speedup": statistics.median(speedups), "speedup_runs": speedups})
    return result


def markdown(report: dict) -> str:
    source = report["provenance"]
    lines = [f"{report['bandwidth_mbit']:g} Mbit/s, GPT {report['model']}, {report['seq_len']} tokens per sequence, "
             f"{report['precision']}; median of {report['repetitions']} interleaved runs; commit "
             f"{source['git_commit']}, {source['machine']['cpu_model']}.", "",
             "| sequences per rank | ZeRO-3 network share | variant | speedup over ZeRO-3 [runs] |", "|---|---|---|---|"]
    for point in report["points"]:
        runs = ", ".join(f"{value:.2f}" for value in point["speedup_runs"])
        lines.append(f"| {point['batch_per_rank']} | {point['zero3_network_share']:.0%} | {point['variant']} | "
                     f"{point['speedup']:.2f}x [{runs}] |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for variant in sorted({point["variant"] for point in report["points"]}):
        mine = sorted((p for p in report["points"] if p["variant"] == variant), key=lambda p: p["zero3_network_share"])
        axis.plot([100 * p["zero3_network_share"] for p in mine], [p["speedup"] for p in mine], "o-", label=variant)
        for point in mine:
            axis.annotate(f"{point['batch_per_rank']}", (100 * point["zero3_network_share"], point["speedup"]),
                          textcoords="offset points", xytext=(4, 4), fontsize=7)
    axis.axhline(1.0, color="gray", linewidth=1)
    axis.axhline(1.3, color="gray", linestyle=":", label="1.3x")
    axis.axvline(45, color="gray", linestyle="--", linewidth=1, label="45% on the network")
    axis.set_xlabel("ZeRO-3's step spent blocked on the network (%)")
    axis.set_ylabel("tokens/s over ZeRO-3's")
    axis.set_title(f"Speedup against network share at {report['bandwidth_mbit']:g} Mbit/s (labels: sequences per rank)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(arguments) -> int:
    precision, why = chosen_precision(arguments.precision)
    logger.info("precision %s (%s)", precision, why)
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(arguments, precision)
    report["precision_why"] = why
    (out / "sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "sweep.md").write_text(markdown(report) + "\n")
    plot(report, out / "sweep.png")
    logger.info("\n%s", markdown(report))
    return 0
