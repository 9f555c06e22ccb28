"""The simulator against the emulated cluster's measurements.

``zeropp bench throughput`` records each fixed scheme's schedule (rank 0's last step) and,
before its runs, calibrates the cluster (:mod:`zeropp_tools.simulation.calibrate`) and
probes each shaped link with the same adapter probe. Each scheme's schedule is then
replayed at every link the benchmark measured, at the rate the probe measured there (the
shaper's nominal rate less TCP's headers where no probe was kept). Nothing is calibrated
per scheme, and no probe is fitted to the runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from zeropp.simulate.hardware import Hardware
from zeropp.simulate.schedule import Schedule
from zeropp.simulate.simulator import simulate
from zeropp_tools.cluster import ClusterSpec, payload_bytes_per_s, shaped_mbit
from zeropp_tools.cluster.runner import run_on_cluster

CALIBRATION = ["-m", "zeropp_tools.simulation.calibrate"]
LINK_PROBES_FILE = "link-probes.json"  # {bandwidth: {adapter_bytes_per_s, source}} of each shaped link


def calibrate_on_cluster(nodes: int, ranks_per_node: int, train_arguments: list[str], out: Path) -> Hardware:
    """Measure the unshaped emulated cluster with the benchmark's model, batch and
    precision; the description is written to ``out``."""
    _run_calibration(ClusterSpec(nodes, ranks_per_node, None), train_arguments, out, [])
    return Hardware.load(str(out))


def probe_shaped_links(nodes: int, ranks_per_node: int, train_arguments: list[str], bandwidths: list[str],
                       out: Path) -> dict:
    """The calibration's link probe on each shaped link of ``bandwidths`` (Mbit/s; "none"
    is the calibration's own); written to ``out`` and returned."""
    probes = {}
    for bandwidth in bandwidths:
        mbit = shaped_mbit(bandwidth)
        if mbit is None:
            continue
        path = out.with_name(f"link-{bandwidth}.json")
        _run_calibration(ClusterSpec(nodes, ranks_per_node, mbit), train_arguments, path,
                         ["--link-only", "--shaped-mbit", str(mbit)])
        probes[bandwidth] = json.loads(path.read_text())
        path.unlink()
    out.write_text(json.dumps(probes, indent=2) + "\n")
    return probes


def _run_calibration(spec: ClusterSpec, train_arguments: list[str], out: Path, extra: list[str]) -> None:
    options = dict(zip(train_arguments[::2], train_arguments[1::2]))
    arguments = ["--out", str(out.resolve()), *extra]
    for flag in ("--model", "--batch-per-rank", "--seq-len", "--precision"):
        if flag in options:
            arguments += [flag, options[flag]]
    result = run_on_cluster(spec, arguments, timeout_s=900, program=CALIBRATION)
    if result["exit_codes"] != [0] * spec.num_nodes:
        raise RuntimeError(f"calibration failed; logs in {result['logs']}")


def link_hardware(hardware: Hardware, bandwidth: str, probes: dict | None = None) -> Hardware:
    """The calibrated cluster with its link shaped to ``bandwidth`` Mbit/s ("none": as
    measured): at the rate ``probes`` measured there, else at the shaper's rate less TCP's
    headers (the shaper counts whole frames)."""
    mbit = shaped_mbit(bandwidth)
    if mbit is None:
        return hardware
    if probes and bandwidth in probes:
        probe = probes[bandwidth]
        return hardware.with_adapters(1, probe["adapter_bytes_per_s"], probe.get("parallel_flows_adapter_bytes_per_s"))
    return hardware.with_adapters(1, payload_bytes_per_s(mbit) / hardware.link_efficiency)  # the description applies its own


def simulated_comparison(report: dict, schedules: Path, hardware: Hardware, probes: dict | None = None) -> list[dict]:
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
            step = simulate(schedule, link_hardware(hardware, bandwidth, probes))
            predicted = tokens_per_step / step.step_s
            rows.append({"bandwidth": bandwidth, "variant": variant, "measured_tokens_per_s": measured,
                         "predicted_tokens_per_s": predicted, "bottleneck": step.bottleneck,
                         "error_percent": (predicted - measured) / measured * 100})
    return rows


def timeline_drift(schedule: Schedule, hardware: Hardware) -> list[dict]:
    """Each recorded event's host time beside the replay's clock there (a cell's schedule
    from ``timelines/``, replayed on that cell's link): where the two part is where the
    model misses."""
    replay = simulate(schedule, hardware)
    return [{"event": index, "type": type(event).__name__.lower(), "recorded_s": event.at_s, "simulated_s": clock}
            for index, (event, clock) in enumerate(zip(schedule.events, replay.event_clock_s))
            if event.at_s is not None]


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
