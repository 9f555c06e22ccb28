"""``zeropp study convergence``: does the model learn as well under compressed communication?

    zeropp study convergence --out runs/convergence          # ~40 minutes on 2 CPU cores

Trains the GPT on the standard-library corpus, 4 ranks as 2 nodes x 2, under ZeRO-3 (three
seeds: the run-to-run noise band) and each compressed variant (seed 0: the same initial
weights and data order as ZeRO-3's first run). Writes each run's metrics (JSON lines), a
plot of validation loss per variant and of its gap to ZeRO-3, and a table (markdown and
JSON) of final validation loss, gap in percent and cross-node bytes per step.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..config import ZeroConfig
from ..launch import spawn_ranks
from ..train import TrainConfig, train

ZERO_PP = dict(quantized_weights=True, hpz_size=2, quantized_gradients=True)
VARIANTS: dict[str, tuple[int, ZeroConfig]] = {
    "zero3": (0, ZeroConfig()),
    "zero3 seed 1": (1, ZeroConfig()),
    "zero3 seed 2": (2, ZeroConfig()),
    "zero++ (int8 w, int4/int4 g)": (0, ZeroConfig(**ZERO_PP)),
    "zero++ with int4 weights": (0, ZeroConfig(**ZERO_PP, weight_bits=4)),
    "ours (int8 w, int8/int4 g + error feedback)": (
        0, ZeroConfig(**ZERO_PP, gradient_bits_intra_node=8, gradient_error_feedback=True),
    ),
}


def _run_name(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def run_study(base: TrainConfig, out: Path, variants: dict = VARIANTS) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name, (seed, zero) in variants.items():
        config = replace(base, seed=seed, zero=zero, metrics_path=str(out / f"{_run_name(name)}.jsonl"))
        summary = spawn_ranks(train, 4, (config,), timeout_s=6 * 3600)[0]
        summaries[name] = summary
        print(f"{name}: final validation loss {summary['validation_loss']:.4f} "
              f"({summary['tokens_per_s']:,.0f} tokens/s)", flush=True)
    report = _table(summaries, out)
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "table.md").write_text(_markdown(report) + "\n")
    _plot(variants, out)
    print(_markdown(report))
    return report


def _table(summaries: dict, out: Path) -> dict:
    baseline = summaries["zero3"]["validation_loss"]
    noise = [abs(s["validation_loss"] - baseline) / baseline * 100 for n, s in summaries.items() if n.startswith("zero3 seed")]
    rows = {}
    for name, summary in summaries.items():
        inter = sum(row.get("received_inter_node", 0) for row in summary["comm_per_step"].values())
        rows[name] = {
            "final_validation_loss": summary["validation_loss"],
            "gap_percent": (summary["validation_loss"] - baseline) / baseline * 100,
            "cross_node_bytes_per_step": inter,
            "metrics": str(out / f"{_run_name(name)}.jsonl"),
        }
    return {"noise_band_percent": max(noise) if noise else None, "runs": rows}


def _markdown(report: dict) -> str:
    lines = ["| run | final validation loss | gap to ZeRO-3 | cross-node MB/step (rank 0) |", "|---|---|---|---|"]
    for name, row in report["runs"].items():
        lines.append(f"| {name} | {row['final_validation_loss']:.4f} | {row['gap_percent']:+.2f}% | "
                     f"{row['cross_node_bytes_per_step'] / 1e6:.3f} |")
    lines.append(f"\nZeRO-3 seed-to-seed noise band: {report['noise_band_percent']:.2f}%")
    return "\n".join(lines)


def _curves(path: Path) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "validation_loss" in record:
            steps.append(record["step"] + 1)
            losses.append(record["validation_loss"])
    return steps, losses


def _plot(variants: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    base_steps, base = _curves(out / f"{_run_name('zero3')}.jsonl")
    for name in variants:
        steps, losses = _curves(out / f"{_run_name(name)}.jsonl")
        style = ":" if name.startswith("zero3 seed") else "-"
        top.plot(steps, losses, style, label=name)
        bottom.plot(steps, [(a - b) / b * 100 for a, b in zip(losses, base)], style, label=name)
    top.set_ylabel("validation loss")
    top.legend(fontsize=8)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("gap to ZeRO-3 (%)")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(out / "convergence.png", dpi=110)


def main(args) -> int:
    base = TrainConfig(
        model_size=args.model, steps=args.steps, batch_per_rank=args.batch_per_rank, seq_len=args.seq_len,
        learning_rate=args.lr, eval_every=args.eval_every, eval_batches=args.eval_batches, ranks_per_node=2,
    )
    run_study(base, Path(args.out))
    return 0
