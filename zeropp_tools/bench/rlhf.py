"""``zeropp bench rlhf``: PPO iterations over four sharded models on the emulated cluster
(2 nodes x 2), side by side at each link bandwidth, repeated in interleaved order:

- ``zero3-per-token``: ZeRO-3, generation gathers every unit again for every token;
- ``zero3-pinned``: ZeRO-3 in generation mode (each unit gathered once per generate call,
  across nodes, unquantized): the DeepSpeed hybrid engine's approach;
- ``zeropp``: hpZ over the node, qwZ through the two-hop gather (each trainable weight
  crosses to a node once, INT8), qgZ and MixZ++ (frozen models INT8 in the node), in
  generation mode.

Each run reads the SFT and reward weights made once beforehand (``zeropp rlhf sft`` and
``reward``). Reported per run: median generation tokens/s, scoring and training seconds,
whole-iteration seconds (the first iteration excluded), cross-node bytes per iteration
from the accounting against the link counters.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.runner import run_on_cluster

from .provenance import provenance

logger = logging.getLogger(__name__)

VARIANTS = {
    "zero3-per-token": ["--per-token-gathers"],
    "zero3-pinned": [],
    "zeropp": ["--qwz", "--two-hop-gather", "--hpz", "2", "--qgz", "--mixz"],
}


def ppo_arguments(weights: Path, out: Path, model: str, iterations: int, variant: str) -> list[str]:
    return ["rlhf", "ppo", "--weights", str(weights), "--out", str(out), "--model", model,
            "--iterations", str(iterations), "--rollouts-per-rank", "8", *VARIANTS[variant]]


def measure(results_json: Path, link_bytes: list[dict]) -> dict:
    every = json.loads(results_json.read_text())["ppo"]["records"]
    records = every[1:]  # the first iteration warms up

    def median(key):
        return statistics.median(row[key] for row in records)

    whole = statistics.median(row["generation_s"] + row["scoring_s"] + row["training_s"] for row in records)
    accounted = sum(sum(row["inter_node_bytes"].values()) for row in every)
    return {
        "generation_tokens_per_s": statistics.median(row["tokens_generated"] / row["generation_s"] for row in records),
        "generation_s": median("generation_s"), "scoring_s": median("scoring_s"), "training_s": median("training_s"),
        "iteration_s": whole,
        "rss_in_generation_over_resting": statistics.median(
            row["memory"]["generation_rss"] / row["memory"]["resting_rss"] for row in records),
        "rss_released_over_resting": statistics.median(
            row["memory"]["released_rss"] / row["memory"]["resting_rss"] for row in records),
        "inter_node_bytes_per_iteration": {name: statistics.median(row["inter_node_bytes"][name] for row in records)
                                           for name in records[0]["inter_node_bytes"]},
        "accounted_inter_node_bytes": accounted,  # every iteration; the link also carried start-up
        "link_rx_bytes_whole_run": sum(counters["rx_bytes"] for counters in link_bytes),
    }


def run(weights: Path, out: Path, bandwidths: list[int | None], repetitions: int, iterations: int,
        model: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repetition in range(repetitions):
        for bandwidth in bandwidths:
            order = list(VARIANTS) if repetition % 2 == 0 else list(reversed(VARIANTS))  # interleaved
            for variant in order:
                folder = out / "runs" / f"{variant}-{bandwidth or 'unshaped'}-{repetition}"
                spec = ClusterSpec(2, 2, bandwidth_mbit=bandwidth)
                result = run_on_cluster(spec, ppo_arguments(weights, folder, model, iterations, variant),
                                        timeout_s=3600, logs=folder / "logs")
                if result["exit_codes"] != [0, 0]:
                    raise RuntimeError(f"{variant} at {bandwidth} Mbit/s failed:\n{result['output'][-3000:]}")
                row = {"variant": variant, "bandwidth_mbit": bandwidth, "repetition": repetition,
                       **measure(folder / "results.json", result["link_bytes"])}
                logger.info("%s", row)
                rows.append(row)
                (out / "rlhf.json").write_text(json.dumps({"provenance": provenance(), "rows": rows}, indent=2))
    return {"provenance": provenance(), "rows": rows}


def ratios(rows: list[dict]) -> dict:
    """Per bandwidth, medians over repetitions and the ratios the issue asks for."""
    table = {}
    for bandwidth in sorted({row["bandwidth_mbit"] or 0 for row in rows}):
        def median(variant, key):
            return statistics.median(row[key] for row in rows
                                     if row["variant"] == variant and (row["bandwidth_mbit"] or 0) == bandwidth)
        table[bandwidth or "unshaped"] = {
            "generation_c_over_b": median("zeropp", "generation_tokens_per_s") / median("zero3-pinned", "generation_tokens_per_s"),
            "generation_c_over_a": median("zeropp", "generation_tokens_per_s") / median("zero3-per-token", "generation_tokens_per_s"),
            "training_zeropp_over_zero3": median("zero3-pinned", "training_s") / median("zeropp", "training_s"),
            "iteration_zeropp_over_zero3_pinned": median("zero3-pinned", "iteration_s") / median("zeropp", "iteration_s"),
        }
    return table


def rebuild(out: Path) -> dict:
    """The rows again from the finished runs' files (after a change to ``measure``)."""
    stored = json.loads((out / "rlhf.json").read_text())
    rows = []
    for row in stored["rows"]:
        folder = out / "runs" / f"{row['variant']}-{row['bandwidth_mbit'] or 'unshaped'}-{row['repetition']}"
        link = [{"rx_bytes": row["link_rx_bytes_whole_run"]}]
        rows.append({key: row[key] for key in ("variant", "bandwidth_mbit", "repetition")}
                    | measure(folder / "results.json", link))
    return {"provenance": stored["provenance"], "rows": rows}


def ratios_markdown(table: dict) -> str:
    lines = ["| link | generation (c)/(b) | generation (c)/(a) | PPO training ZeRO++/ZeRO-3 | whole iteration (c)/(b) |",
             "|---|---|---|---|---|"]
    for bandwidth, row in table.items():
        label = "unshaped" if bandwidth == "unshaped" else f"{bandwidth} Mbit/s"
        lines.append(f"| {label} | {row['generation_c_over_b']:.2f}x | {row['generation_c_over_a']:.2f}x | "
                     f"{row['training_zeropp_over_zero3']:.2f}x | {row['iteration_zeropp_over_zero3_pinned']:.2f}x |")
    return "\n".join(lines)


def write_report(result: dict, out: Path) -> None:
    table = ratios(result["rows"])
    result = {**result, "ratios": table}
    (out / "rlhf.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [ratios_markdown(table)]
    lines += ["", "| variant | link | rep | gen tokens/s | generation s | scoring s | training s | iteration s | "
              "cross-node MB/iteration | accounted MB, run | link rx MB, run | RSS generating / released vs resting |",
              "|---" * 12 + "|"]
    for row in result["rows"]:
        crossing = sum(row["inter_node_bytes_per_iteration"].values()) / 1e6
        lines.append(f"| {row['variant']} | {row['bandwidth_mbit'] or 'unshaped'} | {row['repetition']} | "
                     f"{row['generation_tokens_per_s']:,.0f} | {row['generation_s']:.3f} | {row['scoring_s']:.3f} | "
                     f"{row['training_s']:.3f} | {row['iteration_s']:.3f} | {crossing:,.1f} | "
                     f"{row['accounted_inter_node_bytes'] / 1e6:,.1f} | {row['link_rx_bytes_whole_run'] / 1e6:,.1f} | "
                     f"{row['rss_in_generation_over_resting']:.3f} / {row['rss_released_over_resting']:.3f} |")
    (out / "rlhf.md").write_text("\n".join(lines) + "\n")


def main(arguments) -> int:
    from zeropp_tools.cli.parser import build_parser
    from zeropp_tools.rlhf.cli import run_rlhf

    weights, out = Path(arguments.weights), Path(arguments.out)
    if arguments.report_only:
        write_report(rebuild(out), out)
        logger.info("\n%s", (out / "rlhf.md").read_text())
        return 0
    if not (weights / "reward" / "model.safetensors").is_file():
        logger.info("making the SFT and reward weights in %s", weights)
        making = build_parser().parse_args(["rlhf", "all", "--out", str(weights), "--model", arguments.model,
                                            "--iterations", "1", "--sft-steps", "1", "--reward-body-steps", "1",
                                            "--reward-steps", "1"])
        if run_rlhf(making) != 0:
            raise RuntimeError("could not make the RLHF weights")
    bandwidths = [None if value == "none" else int(value) for value in arguments.bandwidths.split(",")]
    result = run(weights, out, bandwidths, arguments.repetitions, arguments.iterations, arguments.model)
    write_report(result, out)
    logger.info("\n%s", (out / "rlhf.md").read_text())
    return 0
