"""``zeropp bench replan``: auto mode when the network changes under a running job.

    zeropp bench replan                     # 1000 -> 50 Mbit/s at step 15 of 45, GPT medium

One auto-mode run starts on links shaped to ``--from`` Mbit/s; once rank 0 has logged
``--change-at`` steps, every node's link is reshaped to ``--to`` Mbit/s (tc, while the job
runs). Beside it, in the same invocation, each fixed variant that could be best on the
slow link trains at ``--to`` from the start. The figure: how many steps after the change
auto mode runs at >= 90% of the best fixed variant's tokens/s, and stays there (medians of
5 steps). Writes replan.json (with the git commit and the machine), replan.md and
replan.png.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

from zeropp_tools.bench.cells import measure
from zeropp_tools.bench.provenance import chosen_precision, provenance
from zeropp_tools.cluster import ClusterSpec

logger = logging.getLogger(__name__)

FIXED = ("zero++", "zero++-two-hop", "qwz+qgz")
TARGET = 0.9
WINDOW = 5  # steps whose median stands for auto mode's speed at a point of the run


def _change_link_at(step: int, mbit: float):
    """A ``during`` hook: reshape the links once the metrics file has ``step`` lines."""
    def during(cluster, out: Path) -> dict:
        metrics = out / "metrics.jsonl"
        while True:
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            if lines >= step:
                cluster.set_bandwidth(mbit)
                return {"changed_after_step": lines, "changed_at": time.time()}
            time.sleep(0.05)
    return during


def steps_to_recover(step_s: list[float], change_at: int, best_step_s: float) -> int | None:
    """Steps after the change until auto mode runs at >= TARGET of the best fixed variant's
    speed and stays there: from then on the median of every ``WINDOW`` consecutive steps is
    <= best / TARGET (a median, so that one step slowed by the shared machine does not
    count as falling back); None if it never gets there."""
    limit = best_step_s / TARGET
    medians = [statistics.median(step_s[first:first + WINDOW]) for first in range(len(step_s) - WINDOW + 1)]
    for first in range(change_at, len(medians)):
        if all(median <= limit for median in medians[first:]):
            return first - change_at
    return None


def _figures(report: dict) -> dict:
    """The recovery figures of a run with auto mode's step times and the fixed variants'."""
    best = min(report["fixed"], key=lambda name: report["fixed"][name]["median_step_s"])
    best_step_s = report["fixed"][best]["median_step_s"]
    recovered = steps_to_recover(report["auto"]["step_s"], report["change_at"], best_step_s)
    after = report["auto"]["step_s"][report["change_at"] + (recovered or 0):]
    return {"best_fixed": best, "steps_to_recover": recovered,
            "auto_vs_best_fixed_after_recovery": best_step_s / statistics.median(after) if after else None}


def run(arguments, train_arguments: list[str]) -> dict:
    nodes, per_node = arguments.nodes, arguments.ranks_per_node
    fixed = {}
    for variant in FIXED:
        fixed[variant] = measure(ClusterSpec(nodes, per_node, arguments.to_mbit), variant,
                                 [*train_arguments, "--steps", str(arguments.fixed_steps)])
        logger.info("%s at %g Mbit/s: %.2f s per step", variant, arguments.to_mbit, fixed[variant]["median_step_s"])
    auto = measure(ClusterSpec(nodes, per_node, arguments.from_mbit), "auto",
                   [*train_arguments, "--steps", str(arguments.steps)],
                   during=_change_link_at(arguments.change_at, arguments.to_mbit))
    report = {"provenance": provenance(), "train_arguments": train_arguments, "layout": f"{nodes}x{per_node}",
              "from_mbit": arguments.from_mbit, "to_mbit": arguments.to_mbit, "change_at": arguments.change_at,
              "fixed": fixed, "auto": auto}
    return report | _figures(report)


def markdown(report: dict) -> str:
    best = report["best_fixed"]
    lines = [f"Link {report['from_mbit']:g} -> {report['to_mbit']:g} Mbit/s after step {report['change_at']}; "
             f"layout {report['layout']}, {' '.join(report['train_arguments'])}; commit "
             f"{report['provenance']['git_commit']}, {report['provenance']['machine']['cpu_model']}.", "",
             "| at the slow link | median step (s) |", "|---|---|"]
    for variant, result in report["fixed"].items():
        lines.append(f"| {variant}{' (best)' if variant == best else ''} | {result['median_step_s']:.2f} |")
    lines.append("")
    for decision in report["auto"]["auto_decisions"]:
        lines.append(f"- auto, step {decision['step']}: {decision['choice']} at {decision['inter_node_mbit']:,.0f} "
                     f"Mbit/s ({decision['reason']})")
    recovered = report["steps_to_recover"]
    ratio = report["auto_vs_best_fixed_after_recovery"]
    lines.append("")
    lines.append(f"Auto mode reached >= {TARGET:.0%} of {best}'s speed "
                 + (f"{recovered} steps after the change and stayed there ({ratio:.2f}x of it, median)"
                    if recovered is not None else "not at all"))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    steps = report["auto"]["step_s"]
    axis.plot(range(len(steps)), steps, "o-", markersize=3, label="auto mode")
    best = report["fixed"][report["best_fixed"]]["median_step_s"]
    axis.axhline(best, color="gray", linestyle="--", label=f"{report['best_fixed']} at {report['to_mbit']:g} Mbit/s")
    axis.axhline(best / TARGET, color="gray", linestyle=":", label=f"{TARGET:.0%} of its speed")
    axis.axvline(report["change_at"], color="red", linewidth=1, label="link reshaped")
    axis.set_yscale("log")
    axis.set_xlabel("training step")
    axis.set_ylabel("step time (s, log scale)")
    axis.set_title(f"Auto mode, link {report['from_mbit']:g} -> {report['to_mbit']:g} Mbit/s")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(arguments) -> int:
    out = Path(arguments.out)
    if arguments.report_only:
        report = json.loads((out / "replan.json").read_text())
        return _write_report(report | _figures(report), out)
    precision, why = chosen_precision(arguments.precision)
    train_arguments = ["--model", arguments.model, "--batch-per-rank", str(arguments.batch_per_rank),
                       "--seq-len", str(arguments.seq_len), "--precision", precision]
    logger.info("precision %s (%s)", precision, why)
    out.mkdir(parents=True, exist_ok=True)
    report = run(arguments, train_arguments)
    report["precision"] = {"compute_dtype": precision, "why": why}
    return _write_report(report, out)


def _write_report(report: dict, out: Path) -> int:
    (out / "replan.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "replan.md").write_text(markdown(report) + "\n")
    plot(report, out / "replan.png")
    logger.info("\n%s", markdown(report))
    return 0
