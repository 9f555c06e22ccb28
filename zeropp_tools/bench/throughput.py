"""``zeropp bench throughput``: tokens/s of ZeRO-3, the ZeRO++ variants, auto mode and the
peers on an emulated cluster whose inter-node links are shaped to several bandwidths.

    zeropp bench throughput                                   # 2 nodes x 2, GPT medium
    zeropp bench throughput --bandwidths none,200 --variants zero3,zero++ --steps 12

Each (bandwidth, variant) cell is one training run over ``zeropp cluster`` (see
:mod:`zeropp_tools.bench.cells`), repeated ``--repetitions`` times; each repetition visits
the cells in a different order (rotated), so a slow spell of the shared machine does not
land on one variant. A cell reports the median of its runs' tokens/s and their spread
(min, max); ratios are of medians. The precision is the CPU's native one unless given
(bf16 where it has AVX512-BF16 or AMX, else fp32). Writes JSON (with the git commit and the
machine), a markdown table and a plot.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path

from zeropp.auto import candidates
from zeropp.simulate.hardware import Hardware
from zeropp_tools.bench.cells import (PEERS, SUFFIXES, VARIANTS, base_variant, check_peers_can_run, is_variant, measure,
                                      measure_peer)
from zeropp_tools.bench.provenance import chosen_precision, provenance
from zeropp_tools.cluster import ClusterSpec, shaped_mbit
from zeropp_tools.plan import compare, comparison_markdown
from zeropp_tools.schemes import QUALITY_SETTINGS
from zeropp_tools.simulation.compare import (LINK_PROBES_FILE, calibrate_on_cluster, probe_shaped_links,
                                             simulated_comparison, simulated_markdown)

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "cluster-calibration.json"  # the cluster measured as the simulator describes hardware
AUTO_CANDIDATES = frozenset(candidates(ranks_per_node=2))  # every scheme auto mode may choose


def run(nodes: int, ranks_per_node: int, bandwidths: list[str], variants: list[str], train_arguments: list[str],
        out: Path, repetitions: int = 3, known: dict | None = None) -> dict:
    """Measures every (bandwidth, variant) ``repetitions`` times in rotated order; the JSON
    (``known`` and the runs so far) is rewritten after each run, and a failed run is
    recorded with its logs instead of ending the benchmark. Runs already in ``known``
    (a stopped benchmark's) are not measured again; failed ones are."""
    report = {"layout": f"{nodes}x{ranks_per_node}", "train_arguments": train_arguments, "repetitions": repetitions,
              "provenance": provenance(), "runs": {text: {variant: [] for variant in variants} for text in bandwidths},
              **(known or {})}
    if known and "runs" in known:
        report["resumed_provenance"] = provenance()
    cells = [(text, variant) for text in bandwidths for variant in variants]
    for repetition in range(repetitions):
        shift = repetition * len(cells) // repetitions
        for text, variant in cells[shift:] + cells[:shift]:
            if sum("error" not in measured for measured in report["runs"][text][variant]) > repetition:
                continue  # measured already; a failed run is kept with its error and measured again
            spec = ClusterSpec(nodes, ranks_per_node, shaped_mbit(text))
            try:
                measured = (measure_peer if variant in PEERS else measure)(spec, variant, train_arguments)
            except RuntimeError as error:
                measured = {"error": str(error)}
                logger.info(f"{text:>9} Mbit/s {variant:<22} FAILED: {error}")
            _keep_schedule(measured, variant, text, out)
            report["runs"][text][variant].append(measured)
            if "tokens_per_s" in measured:
                logger.info(f"{text:>9} Mbit/s {variant:<22} {measured['tokens_per_s']:>10,.0f} tokens/s "
                            f"(repetition {repetition + 1}/{repetitions})")
            report["results"] = summarize(report["runs"])
            (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _keep_schedule(measured: dict, variant: str, bandwidth: str, out: Path) -> None:
    """Keep a fixed scheme's first recorded schedule as ``schedules/<variant>.json`` (what
    it issues does not depend on the link; auto mode's does, and is not kept), and each
    cell's first as ``timelines/<bandwidth>-<variant>.json``: its events' host times are
    that link's, for holding a replay to the step it replays."""
    path = measured.pop("schedule_path", None)
    if path is None or base_variant(variant) == "auto" or not Path(path).exists():
        return
    for kept in (out / "schedules" / f"{variant}.json", out / "timelines" / f"{bandwidth}-{variant}.json"):
        if not kept.exists():
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, kept)


def summarize(runs: dict) -> dict:
    """Per cell: the median run's figures, the spread of tokens/s, and the speedup of the
    medians over ZeRO-3's."""
    results = {}
    for bandwidth, row in runs.items():
        results[bandwidth] = {}
        for variant, measured in row.items():
            good = [run for run in measured if "tokens_per_s" in run]
            if not good:
                results[bandwidth][variant] = {"error": measured[-1]["error"]} if measured else {"error": "not run"}
                continue
            rates = sorted(run["tokens_per_s"] for run in good)
            median_run = min(good, key=lambda run: abs(run["tokens_per_s"] - statistics.median(rates)))
            cell = {key: value for key, value in median_run.items() if key not in ("step_s", "auto_choices")}
            cell.update(tokens_per_s=statistics.median(rates), tokens_per_s_runs=rates,
                        median_step_s=statistics.median(run["median_step_s"] for run in good))
            steady = [run["steady_tokens_per_s"] for run in good if run.get("steady_tokens_per_s") is not None]
            if steady:  # auto mode's runs that decided before their last step
                cell["steady_tokens_per_s"] = statistics.median(steady)
            results[bandwidth][variant] = cell
        baseline = results[bandwidth].get("zero3", {}).get("tokens_per_s")
        for cell in results[bandwidth].values():
            if "tokens_per_s" in cell and baseline:
                cell["speedup_vs_zero3"] = cell["tokens_per_s"] / baseline
    return results


def markdown(report: dict) -> str:
    variants = list(next(iter(report["results"].values())))
    lines = ["| bandwidth (Mbit/s) | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for bandwidth, row in report["results"].items():
        cells = []
        for variant in variants:
            r = row[variant]
            if "error" in r:
                cells.append("failed")
                continue
            speedup = f" ({r['speedup_vs_zero3']:.2f}x)" if r.get("speedup_vs_zero3") else ""
            exposed = f", comm {r['exposed_fraction']:.0%}" if "exposed_fraction" in r else ""
            runs = r["tokens_per_s_runs"]
            spread = f" [{runs[0]:,.0f}-{runs[-1]:,.0f}]" if len(runs) > 1 else ""
            chosen = f", ran {r['auto_decisions'][-1]['choice']}" if r.get("auto_decisions") else ""
            memory = f", {r['peak_rss_increase_bytes'] / 1e6:,.0f} MB" if "peak_rss_increase_bytes" in r else ""
            cells.append(f"{r['tokens_per_s']:,.0f}{spread}{speedup}{exposed}{memory}{chosen}")
        label = "unshaped" if shaped_mbit(bandwidth) is None else bandwidth
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any("peak_rss_increase_bytes" in cell for row in report["results"].values() for cell in row.values()):
        lines += ["", "MB: the median run's peak resident-set growth per rank (the largest rank), above what the "
                      "rank held before building the model."]
    return "\n".join(lines)


def header(report: dict) -> str:
    source = report["provenance"]
    machine = source["machine"]
    return (f"Layout {report['layout']}, {' '.join(report['train_arguments'])} "
            f"({report['precision']['why']}); median of {report['repetitions']} interleaved runs per cell, "
            f"[min-max] of the runs; commit {source['git_commit']}, {machine['cpu_model']} "
            f"({machine['cores']} cores, {', '.join(machine['cpu_flags'])}), torch {source['torch']}.\n\n")


def ratios(results: dict) -> dict:
    """Per bandwidth, the ratios the targets are stated in (medians of the same run)."""
    table = {}
    for bandwidth, row in results.items():
        rate = {variant: cell["tokens_per_s"] for variant, cell in row.items() if "tokens_per_s" in cell}
        fixed = {variant: value for variant, value in rate.items() if is_variant(variant) and base_variant(variant) != "auto"}
        # Auto mode chooses among its candidates' schemes and leaves the rest (bits, grids,
        # prefetching) to the user, so it is held to the best of those.
        choices = {variant: value for variant, value in fixed.items() if variant in AUTO_CANDIDATES}
        entry = {}
        if choices:
            best = max(choices, key=choices.get)
            entry["best_fixed"] = best
            if "auto" in rate:
                entry["auto_vs_best_fixed"] = rate["auto"] / choices[best]
        if fixed and "zero3" in rate:
            entry["slowest_fixed_vs_zero3"] = min(fixed.values()) / rate["zero3"]
        if "zero++" in rate:
            for peer in ("fsdp2", "deepspeed"):
                peers = [value for variant, value in rate.items() if variant.startswith(peer)]
                if peers:
                    entry[f"zero++_vs_best_{peer}"] = rate["zero++"] / max(peers)
            if "zero3" in rate:
                entry["zero++_vs_zero3"] = rate["zero++"] / rate["zero3"]
            for variant in rate:  # a best-quality setting at ZeRO++'s bytes: is it as fast?
                if base_variant(variant) in QUALITY_SETTINGS:
                    entry[f"{variant}_vs_zero++"] = rate[variant] / rate["zero++"]
            if "deltas" in rate:  # issue 17's setting against ZeRO++: speed, and what node 0's link carried
                entry["deltas_vs_zero++"] = rate["deltas"] / rate["zero++"]
                # Whole runs (the first, exact fp32 gather of the weights included), from the
                # link counters; the accounting's per-step figures are in the convergence study.
                entry["deltas_link_bytes_vs_zero++"] = (row["deltas"]["node0_link_rx_payload_bytes"]
                                                        / row["zero++"]["node0_link_rx_payload_bytes"])
        table[bandwidth] = entry
    return table


def ratios_markdown(table: dict) -> str:
    lines = []
    for bandwidth, entry in table.items():
        label = "unshaped" if shaped_mbit(bandwidth) is None else f"{bandwidth} Mbit/s"
        cells = ", ".join(f"{name} {value:.2f}x" if isinstance(value, float) else f"{name} {value}"
                          for name, value in entry.items())
        lines.append(f"- {label}: {cells}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = list(report["results"])
    variants = list(report["results"][bandwidths[0]])
    labels = ["unshaped" if shaped_mbit(b) is None else b for b in bandwidths]
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for variant in variants:
        cells = [(label, report["results"][b][variant]) for b, label in zip(bandwidths, labels)]
        cells = [(label, cell) for label, cell in cells if "tokens_per_s" in cell]
        medians = [cell["tokens_per_s"] for _, cell in cells]
        spread = [[m - cell["tokens_per_s_runs"][0] for m, (_, cell) in zip(medians, cells)],
                  [cell["tokens_per_s_runs"][-1] - m for m, (_, cell) in zip(medians, cells)]]
        style = "o-" if is_variant(variant) else "s--"  # zeropp solid, peers dashed
        axis.errorbar([label for label, _ in cells], medians, yerr=spread, fmt=style, capsize=3, label=variant)
    axis.set_yscale("log")
    axis.set_xlabel("inter-node bandwidth per node (Mbit/s)")
    axis.set_ylabel("tokens/s (log scale)")
    axis.set_title(f"GPT on an emulated {report['layout']} cluster")
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(args) -> int:
    out = Path(args.out)
    has_report = (out / "throughput.json").exists()
    if args.resume and not has_report:  # stopped before its first run (calibrating): nothing to keep
        logger.info("--resume: no report in %s yet, starting afresh", out)
    elif args.report_only or args.resume:  # a benchmark that stopped early: its JSON holds every finished run
        report = json.loads((out / "throughput.json").read_text())
        if args.resume:
            return _resume(report, out)
        report["results"] = summarize(report["runs"])
        return _write_report(report, out)
    precision, why = chosen_precision(args.precision)
    logger.info("precision %s (%s)", precision, why)
    train_arguments = ["--model", args.model, "--steps", str(args.steps), "--batch-per-rank", str(args.batch_per_rank),
                       "--seq-len", str(args.seq_len), "--precision", precision]
    bandwidths = args.bandwidths.split(",")
    for bandwidth in bandwidths:
        shaped_mbit(bandwidth)  # a bad entry is an error now, not after the calibration
    variants = args.variants.split(",")
    unknown = [v for v in variants if not is_variant(v) and v not in PEERS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed values: {[*VARIANTS, *PEERS]}, "
                         f"a variant of zeropp also with any of {list(SUFFIXES)} appended")
    check_peers_can_run(variants)
    out.mkdir(parents=True, exist_ok=True)
    calibrate_on_cluster(args.nodes, args.ranks_per_node, train_arguments, out / CALIBRATION_FILE)
    probe_shaped_links(args.nodes, args.ranks_per_node, train_arguments, bandwidths, out / LINK_PROBES_FILE)
    report = run(args.nodes, args.ranks_per_node, bandwidths, variants, train_arguments, out,
                 args.repetitions, known={"precision": {"compute_dtype": precision, "why": why}})
    return _write_report(report, out)


def _resume(report: dict, out: Path) -> int:
    """Measures what a stopped benchmark left unmeasured, with its own bandwidths, variants,
    training arguments and repetitions (the flags given now are not used)."""
    nodes, ranks_per_node = (int(text) for text in report["layout"].split("x"))
    bandwidths = list(report["runs"])
    variants = list(report["runs"][bandwidths[0]])
    check_peers_can_run(variants)
    logger.info("resuming %s: %s at %s Mbit/s, %s", out, ",".join(variants), ",".join(bandwidths),
                " ".join(report["train_arguments"]))
    report = run(nodes, ranks_per_node, bandwidths, variants, report["train_arguments"], out, report["repetitions"],
                 report)
    return _write_report(report, out)


def _write_report(report: dict, out: Path) -> int:
    report["ratios"] = ratios(report["results"])
    report["planner"] = compare(report)  # the planner's step times against these measurements
    simulated = ""
    if (out / CALIBRATION_FILE).exists() and (out / "schedules").is_dir():
        hardware = Hardware.load(str(out / CALIBRATION_FILE))
        probes_path = out / LINK_PROBES_FILE
        probes = json.loads(probes_path.read_text()) if probes_path.exists() else None
        report["calibration"] = asdict(hardware)
        report["link_probes"] = probes
        report["simulator"] = simulated_comparison(report, out / "schedules", hardware, probes)
        simulated = "\n\n" + simulated_markdown(report["simulator"])
        logger.info(simulated_markdown(report["simulator"]))
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "throughput.md").write_text(header(report) + markdown(report) + "\n\n" + ratios_markdown(report["ratios"])
                                       + "\n\n" + comparison_markdown(report["planner"]) + simulated + "\n")
    plot(report, out / "throughput.png")
    logger.info(markdown(report))
    logger.info(ratios_markdown(report["ratios"]))
    logger.info(comparison_markdown(report["planner"]))
    logger.info(f"wrote {out}/throughput.json, throughput.md, throughput.png")
    return 0
