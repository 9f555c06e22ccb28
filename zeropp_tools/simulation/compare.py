"""The simulator against the emulated cluster's measurements.

``zeropp bench throughput`` records each fixed scheme's schedule (rank 0's last step) and,
before its runs, calibrates the cluster (:mod:`zeropp_tools.simulation.calibrate`). Each
scheme's schedule is then replayed at every link the benchmark measured: the unshaped link
at the rate the calibration measured, a shaped one at the shaper's rate. Nothing is
calibrated per scheme or per link.
"""

from __future__ import annotations

import json
from pathlib import Path

from zeropp.simulate.hardware import Hardware
from zeropp.simulate.schedule import Schedule
from zeropp.simulate.simulator import simulate
from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.runner import run_on_cluster

CALIBRATION = ["-m", "zeropp_tools.simulation.calibrate"]


def calibrate_on_cluster(nodes: int, ranks_per_node: int, train_arguments: list[str], out: Path) -> Hardware:
    """Measure the unshaped emulated cluster with the benchmark's model, batch and
    precision; the description is written to ``out``."""
    options = dict(zip(train_arguments[::2], train_arguments[1::2]))
    arguments = ["--out", str(out.resolve())]
    for flag in ("--model", "--batch-per-rank", "--seq-len", "--precision"):
        if flag in options:
            arguments += [flag, options[flag]]
    result = run_on_cluster(ClusterSpec(nodes, ranks_per_node, None), arguments, timeout_s=900, program=CALIBRATION)
    if result["exit_codes"] != [0] * nodes:
        raise RuntimeError(f"calibration failed; logs in {result['logs']}")
    return Hardware.load(str(out))


def link_hardware(hardware: Hardware, bandwidth: str) -> Hardware:
    """The calibrated cluster with its link shaped to ``bandwidth`` Mbit/s ("none": as measured)."""
    if bandwidth in ("none", "unshaped"):
        return hardware
    return hardware.with_adapters(1, float(bandwidth) * 1e6 / 8)


def simulated_comparison(report: dict, schedules: Path, hardware: Hardware) -> list[dict]:
    """Predicted against measured tokens/s for every scheme with a schedule and a result."""
    rows = []
    for path in sorted(schedules.glob("*.json")):
        variant = path.stem
        schedule = Schedule.load(path)
        tokens_per_step = schedule.tokens_per_rank * schedule.world_size * _micro_steps(report)
        for bandwidth, results in report["results"].items():
            measured = results.get(variant, {}).get("tokens_per_s")
            if measured is None:
                continue
            step = simulate(schedule, link_hardware(hardware, bandwidth))
            predicted = tokens_per_step / step.step_s
            rows.append({"bandwidth": bandwidth, "variant": variant, "measured_tokens_per_s": measured,
                         "predicted_tokens_per_s": predicted, "bottleneck": step.bottleneck,
                         "error_percent": (predicted - measured) / measured * 100})
    return rows


def _micro_steps(report: dict) -> int:
    options = dict(zip(report["train_arguments"][::2], report["train_arguments"][1::2]))
    return int(options.get("--accumulation", 1))


def simulated_markdown(rows: list[dict]) -> str:
    if not rows:
        return "simulator: no scheme has both a recorded schedule and a measurement"
    lines = ["| link (Mbit/s) | scheme | measured tokens/s | simulated | error | bounded by |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['bandwidth']} | {row['variant']} | {row['measured_tokens_per_s']:,.0f} | "
                     f"{row['predicted_tokens_per_s']:,.0f} | {row['error_percent']:+.1f}% | {row['bottleneck']} |")
    worst = max(abs(row["error_percent"]) for row in rows)
    within = sum(abs(row["error_percent"]) <= 15 for row in rows)
    lines.append(f"\nsimulator vs measured: {within} of {len(rows)} within 15%, largest error {worst:.1f}%")
    return "\n".join(lines)


def load_report(path: Path) -> dict:
    return json.loads(path.read_text())
