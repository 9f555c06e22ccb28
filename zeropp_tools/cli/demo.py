"""``zeropp demo``: ZeRO-3 and ZeRO++ trained side by side on 4 CPU ranks as 2 nodes x 2.

Both runs share the model, seed, data and step count, so the table isolates what ZeRO++
changes: far fewer bytes across nodes, at a small cost in loss. On one machine the
"nodes" share loopback, so tokens/s shows quantization's compute cost and none of the
bandwidth it saves; ``zeropp bench throughput`` measures that on shaped links.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path

from zeropp.config import ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.train import TrainConfig, train
from zeropp.train.loop import write_summary

from .run_folder import run_folder

logger = logging.getLogger(__name__)

WORLD_SIZE = 4
RANKS_PER_NODE = 2
# variant label -> (subfolder, settings). ZeRO++ is all three optimizations, hpZ over the
# whole 2-rank node, in fp32 compute like the ZeRO-3 baseline.
VARIANTS = {
    "ZeRO-3": ("zero3", ZeroConfig()),
    "ZeRO++": ("zeropp", ZeroConfig(quantized_weights=True, hpz_size=RANKS_PER_NODE, quantized_gradients=True)),
}
PLOT_FILE = "demo.png"
MEGABYTE = 1e6  # as in the training report's communication table
SPAWN_TIMEOUT_S = 3600


def run_demo(arguments) -> int:
    out = Path(arguments.out)
    base = TrainConfig(
        model_size=arguments.model, steps=arguments.steps, batch_per_rank=arguments.batch_per_rank,
        seq_len=arguments.seq_len, seed=arguments.seed, ranks_per_node=RANKS_PER_NODE,
    )  # validated here, before any folder exists
    summaries = {}
    for number, (label, (folder, zero)) in enumerate(VARIANTS.items(), start=1):
        logger.info("[%d/%d] training %s: GPT %s, %d steps, %d ranks = %d nodes x %d ...", number, len(VARIANTS),
                    label, base.model_size, base.steps, WORLD_SIZE, WORLD_SIZE // RANKS_PER_NODE, RANKS_PER_NODE)
        summaries[label] = _train_variant(base, zero, out / folder)
    plot_demo(summaries, out / PLOT_FILE)
    logger.info("")
    logger.info(demo_report(summaries, out))
    return 0


def _train_variant(base: TrainConfig, zero: ZeroConfig, folder: Path) -> dict:
    config = replace(base, zero=zero, metrics_path=str(folder / "metrics.jsonl"))
    with run_folder(folder):
        summary = spawn_ranks(train, WORLD_SIZE, (config,), timeout_s=SPAWN_TIMEOUT_S,
                              collective_timeout_s=config.collective_timeout_s)[0]
        write_summary(summary, folder / "summary.json")
    return summary


def cross_node_bytes(summary: dict) -> int:
    """Bytes rank 0 received from other nodes in one step, summed over every phase."""
    return sum(phase.get("received_inter_node", 0) for phase in summary["comm_per_step"].values())


def demo_report(summaries: dict[str, dict], out: Path) -> str:
    """A table of the variants, then ZeRO-3 / ZeRO++ cross-node bytes and the validation
    loss gap. ``summaries`` maps "ZeRO-3" and "ZeRO++" to their training summaries."""
    baseline, compressed = summaries["ZeRO-3"], summaries["ZeRO++"]
    config = baseline["config"]
    header = f"{'variant':<10}{'train loss':>12}{'val loss':>12}{'cross-node MB/step':>21}{'tokens/s':>12}"
    lines = [
        f"GPT {config['model_size']} ({config['num_parameters']:,} parameters), {len(baseline['losses'])} steps, "
        f"{config['world_size']} CPU ranks = {config['num_nodes']} nodes x {config['ranks_per_node']}, fp32, "
        f"seed {config['seed']}",
        header,
        "-" * len(header),
    ]
    for label, summary in summaries.items():
        lines.append(
            f"{label:<10}{summary['final_train_loss']:>12.4f}{summary['validation_loss']:>12.4f}"
            f"{cross_node_bytes(summary) / MEGABYTE:>21.3f}{summary['tokens_per_s']:>12,.0f}"
        )
    ratio = cross_node_bytes(baseline) / max(cross_node_bytes(compressed), 1)
    gap = (compressed["validation_loss"] - baseline["validation_loss"]) / baseline["validation_loss"] * 100
    lines += [
        "",
        f"cross-node bytes per step (rank 0), ZeRO-3 / ZeRO++: {ratio:.1f}x",
        f"validation loss, ZeRO++ vs ZeRO-3: {gap:+.2f}%",
        "tokens/s: all ranks share this machine's cores and loopback, so they time compute,",
        "          not the link ZeRO++ saves on (`zeropp bench throughput` shapes one)",
        f"plot: {out / PLOT_FILE}   runs: {', '.join(str(out / folder) for folder, _ in VARIANTS.values())}",
    ]
    return "\n".join(lines)


def plot_demo(summaries: dict[str, dict], path: Path) -> None:
    """Loss curves of every variant (left) and cross-node MB per step (right), as a PNG.
    A bare Figure on the Agg canvas: no pyplot, so no GUI backend and no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), dpi=110)
    FigureCanvasAgg(figure)
    losses, traffic = figure.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    colors = dict(zip(summaries, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for label, summary in summaries.items():
        _plot_losses(losses, label, summary, colors[label])
    losses.set_xlabel("step")
    losses.set_ylabel("training loss")
    losses.set_title("training loss, same seed and data (10-step mean; faint: each step)", fontsize=10)
    losses.legend()
    _plot_traffic(traffic, summaries, colors)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def _plot_losses(axis, label: str, summary: dict, color: str) -> None:
    steps = range(1, len(summary["losses"]) + 1)
    axis.plot(steps, summary["losses"], color=color, alpha=0.25, linewidth=0.8)
    axis.plot(steps, _moving_average(summary["losses"], 10), color=color, linewidth=1.8,
              label=f"{label} (validation {summary['validation_loss']:.3f})")


def _plot_traffic(axis, summaries: dict[str, dict], colors: dict[str, str]) -> None:
    labels = list(summaries)
    megabytes = [cross_node_bytes(summaries[label]) / MEGABYTE for label in labels]
    bars = axis.bar(labels, megabytes, color=[colors[label] for label in labels])
    axis.bar_label(bars, fmt="%.2f MB")
    axis.set_ylabel("MB per step into rank 0")
    axis.set_title("received from other nodes", fontsize=10)
    axis.margins(y=0.2)  # room for the labels above the bars


def _moving_average(values: list[float], window: int) -> list[float]:
    """Centred mean over up to ``window`` values (fewer at the ends): per-step losses are
    too noisy to compare, and a centred window does not lag the curve like a trailing one."""
    half = window // 2
    return [statistics.fmean(values[max(0, index - half):index + half + 1]) for index in range(len(values))]
