"""``zeropp bench accumulation``: tokens/s per optimizer step against the number of
accumulated micro-batches k, on an emulated cluster whose inter-node links are shaped.

    zeropp bench accumulation                       # 2 x 2, GPT medium, 200 and 50 Mbit/s, k = 1, 4, 8

Compared in each (bandwidth, k) cell: zeropp ZeRO++ with node accumulation (micro-steps
1..k-1 reduce inside the node, the last one crosses nodes once), the same reducing across
nodes in every micro-step (``-every-micro-step``), the peers at their best set-up on this
cluster in the throughput benchmark (DeepSpeed ZeRO++ with ``gradient_accumulation_steps``
k, which reduces in every micro-step; FSDP2 HSDP with ``set_requires_gradient_sync(False)``
on the first k-1 micro-steps), and the compute-bound limit: ZeRO-3 on an unshaped link
with the same k. Every cell runs ``--repetitions`` times, each repetition in a rotated
order; the JSON is rewritten after each run (``--resume`` measures what a stopped run left).
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from zeropp_tools.bench.cells import PEERS, is_variant, measure, measure_peer
from zeropp_tools.bench.provenance import chosen_precision, provenance
from zeropp_tools.cluster import ClusterSpec, payload_bytes_per_s, shaped_mbit

logger = logging.getLogger(__name__)

NODE_ACCUMULATION = "zero++"
EVERY_MICRO_STEP = "zero++-every-micro-step"
LIMIT = "zero3"  # on the unshaped link
UNSHAPED = "none"


def _cells(bandwidths: list[str], accumulations: list[int], variants: list[str]) -> list[tuple[str, int, str]]:
    """(bandwidth, k, variant) of every measurement: the variants at each shaped bandwidth,
    the limit unshaped. With k = 1 node accumulation and reducing every micro-step are the
    same run, so only the first is measured."""
    cells = [(UNSHAPED, k, LIMIT) for k in accumulations]
    for bandwidth in bandwidths:
        for k in accumulations:
            cells += [(bandwidth, k, variant) for variant in variants if not (k == 1 and variant == EVERY_MICRO_STEP)]
    return cells


def _key(bandwidth: str, k: int, variant: str) -> str:
    return f"{bandwidth}/{k}/{variant}"


def run(report: dict, out: Path) -> dict:
    """Measures every cell ``report['repetitions']`` times in rotated order, skipping runs
    already in ``report['runs']``; a failed run is recorded with its error."""
    cells = _cells(report["bandwidths"], report["accumulations"], report["variants"])
    runs = report.setdefault("runs", {})
    repetitions = report["repetitions"]
    nodes, ranks_per_node = (int(text) for text in report["layout"].split("x"))
    for repetition in range(repetitions):
        shift = repetition * len(cells) // repetitions
        for bandwidth, k, variant in cells[shift:] + cells[:shift]:
            measured_so_far = runs.setdefault(_key(bandwidth, k, variant), [])
            if len(measured_so_far) > repetition:
                continue
            spec = ClusterSpec(nodes, ranks_per_node, shaped_mbit(bandwidth))
            arguments = [*report["train_arguments"], "--accumulation", str(k)]
            if variant not in PEERS:
                arguments += report.get("zeropp_arguments", [])
            try:
                measured = (measure_peer if variant in PEERS else measure)(spec, variant, arguments)
            except RuntimeError as error:
                measured = {"error": str(error)}
            measured_so_far.append(measured)
            logger.info("%9s Mbit/s k=%d %-24s %s (repetition %d/%d)", bandwidth, k, variant,
                        f"{measured['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in measured else "FAILED",
                        repetition + 1, repetitions)
            report["results"] = summarize(runs)
            (out / "accumulation.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def summarize(runs: dict) -> dict:
    """Per cell: the median tokens/s of its runs, their spread, and node 0's link bytes."""
    results = {}
    for key, measured in runs.items():
        good = [run for run in measured if "tokens_per_s" in run]
        if not good:
            results[key] = {"error": measured[-1]["error"] if measured else "not run"}
            continue
        rates = sorted(run["tokens_per_s"] for run in good)
        results[key] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                        "node0_link_rx_payload_bytes": statistics.median(run["node0_link_rx_payload_bytes"] for run in good)}
        if all("peak_rss_increase_bytes" in run for run in good):
            results[key]["peak_rss_increase_bytes"] = statistics.median(run["peak_rss_increase_bytes"] for run in good)
    return results


def ratios(report: dict, ours_variant: str = NODE_ACCUMULATION) -> dict:
    """Per bandwidth and k, the ratios the targets are stated in (medians of one run), of
    ``ours_variant`` (a zeropp variant accumulating under ``no_sync``)."""
    results = report["results"]
    table = {}
    for bandwidth in report["bandwidths"]:
        for k in report["accumulations"]:
            rate = {variant: results.get(_key(bandwidth, k, variant), {}).get("tokens_per_s")
                    for variant in report["variants"]}
            if k == 1:
                rate[EVERY_MICRO_STEP] = rate.get(NODE_ACCUMULATION)
            limit = results.get(_key(UNSHAPED, k, LIMIT), {}).get("tokens_per_s")
            ours = rate.get(ours_variant)
            if not ours:
                continue
            entry = {}
            if limit:
                entry["vs_limit"] = ours / limit
            if rate.get(EVERY_MICRO_STEP):
                entry["vs_every_micro_step"] = ours / rate[EVERY_MICRO_STEP]
            for variant, value in rate.items():
                if variant in PEERS and value:
                    entry[f"vs_{variant}"] = ours / value
            table[f"{bandwidth}/{k}"] = entry
    return table


def overlap_bound(report: dict, bandwidth: str, k: int, variant: str) -> dict:
    """The fastest any exact schedule could run ``variant`` in the (``bandwidth``, k) cell,
    from the cell's own runs and the limit's.

    With node accumulation the link carries two things per optimizer step: the weights, which
    exist only after the optimizer step and are all needed before the first micro-step's
    backward, and the node sums, which exist only as the last micro-step's backward makes
    them. So only the first forward and the last backward, one micro-step (the limit's step /
    k), can hide the link's time; the rest of it adds to the limit's step. A schedule whose
    micro-steps do less than the limit's (weights kept between them) is not bounded by it.
    Node 0's bytes are rank 0's times the node's ranks: true where every rank of a node
    receives alike across nodes, as with the delta gather (each local index exchanges with
    its peers), not with a ring gather over the world (there one rank per node receives)."""
    def median(cell: str, field: str) -> float:
        return statistics.median(run[field] for run in report["runs"][cell] if field in run)

    limit_cell, cell = _key(UNSHAPED, k, LIMIT), _key(bandwidth, k, variant)
    limit_step_s = median(limit_cell, "median_step_s")
    tokens_per_step = median(limit_cell, "tokens_per_s") * limit_step_s
    ranks_per_node = int(report["layout"].split("x")[1])
    node_bytes = ranks_per_node * median(cell, "rank0_inter_node_bytes_per_step")  # into node 0, by symmetry
    link_s = node_bytes / payload_bytes_per_s(shaped_mbit(bandwidth))
    hidden_s = limit_step_s / k
    fastest_step_s = limit_step_s + max(0.0, link_s - hidden_s)
    every_micro_step = report["results"][_key(bandwidth, k, EVERY_MICRO_STEP)]["tokens_per_s"]
    return {"node_bytes": node_bytes, "link_s": link_s, "limit_step_s": limit_step_s, "hidden_s": hidden_s,
            "fastest_step_s": fastest_step_s, "fastest_tokens_per_s": tokens_per_step / fastest_step_s,
            "measured_tokens_per_s": report["results"][cell]["tokens_per_s"], "every_micro_step": every_micro_step}


def link_only_markdown(report: dict, bandwidth: str, k: int, variant: str, against: str) -> str:
    """``variant``'s tokens/s were nothing but node 0's link busy with its bytes, and ``against``'s
    measured tokens/s beside it."""
    def median(cell: str, field: str) -> float:
        return statistics.median(run[field] for run in report["runs"][cell] if field in run)

    cell = _key(bandwidth, k, variant)
    tokens_per_step = median(cell, "tokens_per_s") * median(cell, "median_step_s")
    ranks_per_node = int(report["layout"].split("x")[1])
    node_bytes = ranks_per_node * median(cell, "rank0_inter_node_bytes_per_step")
    link_s = node_bytes / payload_bytes_per_s(shaped_mbit(bandwidth))
    ours = report["results"][_key(bandwidth, k, against)]["tokens_per_s"]
    return (f"At {bandwidth} Mbit/s with k = {k}, {variant} brings node 0 {node_bytes / 1e6:.1f} MB per optimizer "
            f"step, {link_s:.2f} s at the shaper's payload rate: with nothing else in its step it would run at "
            f"{tokens_per_step / link_s:,.0f} tokens/s; {against} runs at {ours:,.0f}, "
            f"{ours * link_s / tokens_per_step:.2f}x that.")


def bound_markdown(report: dict, bandwidth: str, k: int, variant: str) -> str:
    bound = overlap_bound(report, bandwidth, k, variant)
    every = bound["every_micro_step"]
    return (f"At {bandwidth} Mbit/s with k = {k} ({variant}), node 0's link carries "
            f"{bound['node_bytes'] / 1e6:.2f} MB per optimizer step, {bound['link_s']:.2f} s at the shaper's "
            f"payload rate; one micro-step, {bound['hidden_s']:.2f} s of the limit's "
            f"{bound['limit_step_s']:.2f} s step, is all that can hide it while each micro-step works as the "
            f"limit's does. The fastest such step is then "
            f"{bound['fastest_step_s']:.2f} s, {bound['fastest_tokens_per_s']:,.0f} tokens/s: "
            f"{bound['fastest_tokens_per_s'] / every:.2f}x reducing every micro-step "
            f"({every:,.0f} tokens/s). Measured: {bound['measured_tokens_per_s']:,.0f} tokens/s, "
            f"{bound['measured_tokens_per_s'] / every:.2f}x.")


def ratios_markdown(report: dict, ours_variant: str) -> str:
    return "\n".join([f"{ours_variant} against each, per bandwidth/k:"] + [
        f"- {cell}: " + ", ".join(f"{name} {value:.2f}x" for name, value in entry.items())
        for cell, entry in ratios(report, ours_variant).items()])


def markdown(report: dict) -> str:
    variants = [*report["variants"], f"{LIMIT} unshaped (limit)"]
    lines = []
    for bandwidth in report["bandwidths"]:
        lines += [f"**{bandwidth} Mbit/s**, tokens/s per optimizer step, median [min-max]:", "",
                  "| k | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for k in report["accumulations"]:
            cells = []
            for variant in variants:
                key = (_key(UNSHAPED, k, LIMIT) if variant.startswith(f"{LIMIT} unshaped")
                       else _key(bandwidth, k, NODE_ACCUMULATION if k == 1 and variant == EVERY_MICRO_STEP else variant))
                cell = report["results"].get(key, {"error": "not run"})
                if "error" in cell:
                    cells.append("failed")
                    continue
                runs = cell["tokens_per_s_runs"]
                memory = f" · {cell['peak_rss_increase_bytes'] / 1e6:,.0f} MB" if "peak_rss_increase_bytes" in cell else ""
                cells.append(f"{cell['tokens_per_s']:,.0f} [{runs[0]:,.0f}-{runs[-1]:,.0f}]{memory}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
    if any("peak_rss_increase_bytes" in cell for cell in report["results"].values()):
        lines += ["MB: peak resident-set growth per rank over the run, above what the rank held before "
                  "building the model (the largest rank; median over the runs).", ""]
    lines.append("Node accumulation (zero++) against each, per bandwidth/k:")
    for cell, entry in report.get("ratios", {}).items():
        lines.append(f"- {cell}: " + ", ".join(f"{name} {value:.2f}x" for name, value in entry.items()))
    return "\n".join(lines)


def header(report: dict) -> str:
    source, machine = report["provenance"], report["provenance"]["machine"]
    zeropp_only = " ".join(report.get("zeropp_arguments", []))
    zeropp_only = f" (zeropp's cells, the limit's too: {zeropp_only})" if zeropp_only else ""
    return (f"`zeropp bench accumulation`, layout {report['layout']}, {' '.join(report['train_arguments'])}{zeropp_only} "
            f"({report['precision']['why']}), k = {report['accumulations']}; median of {report['repetitions']} "
            f"interleaved runs per cell; commit {source['git_commit']}, {machine['cpu_model']} ({machine['cores']} "
            f"cores, {', '.join(machine['cpu_flags'])}), torch {source['torch']}.\n\n")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths, ks = report["bandwidths"], report["accumulations"]
    figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), sharey=True, squeeze=False)
    for axis, bandwidth in zip(axes[0], bandwidths):
        lines = [(variant, bandwidth) for variant in report["variants"]] + [(LIMIT, UNSHAPED)]
        for variant, where in lines:
            points = []
            for k in ks:
                name = NODE_ACCUMULATION if k == 1 and variant == EVERY_MICRO_STEP else variant
                cell = report["results"].get(_key(where, k, name), {})
                if "tokens_per_s" in cell:
                    points.append((k, cell["tokens_per_s"]))
            if points:
                label = f"{LIMIT} unshaped (limit)" if where == UNSHAPED else variant
                style = "k:" if where == UNSHAPED else ("o-" if is_variant(variant) else "s--")
                axis.plot(*zip(*points), style, label=label)
        axis.set_title(f"{bandwidth} Mbit/s between nodes")
        axis.set_xlabel("micro-batches per optimizer step (k)")
        axis.set_xticks(ks)
    axes[0][0].set_ylabel("tokens/s")
    axes[0][-1].legend(fontsize=8)
    figure.suptitle(f"Gradient accumulation on an emulated {report['layout']} cluster")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(args) -> int:
    out = Path(args.out)
    if args.resume or args.report_only:
        report = json.loads((out / "accumulation.json").read_text())
        report.setdefault("resumed_provenance", []).append(provenance())
        if args.resume:
            report = run(report, out)
        return _write_report(report, out)
    variants = args.variants.split(",")
    unknown = [v for v in variants if not is_variant(v) and v not in PEERS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed: zeropp's variants (with suffixes) and {list(PEERS)}")
    accumulations = [int(text) for text in args.accumulations.split(",")]
    if any(k < 1 for k in accumulations):
        raise ValueError(f"--accumulations must be positive integers, got {args.accumulations!r}")
    precision, why = chosen_precision(args.precision)
    train_arguments = ["--model", args.model, "--steps", str(args.steps), "--untimed-steps", str(args.untimed_steps),
                       "--batch-per-rank", str(args.batch_per_rank), "--seq-len", str(args.seq_len),
                       "--precision", precision]
    out.mkdir(parents=True, exist_ok=True)
    report = {"layout": f"{args.nodes}x{args.ranks_per_node}", "train_arguments": train_arguments,
              "precision": {"compute_dtype": precision, "why": why}, "bandwidths": args.bandwidths.split(","),
              "accumulations": accumulations, "variants": variants, "repetitions": args.repetitions,
              "zeropp_arguments": ["--keep-weights-between-micro-steps"] if args.keep_weights_between_micro_steps else [],
              "provenance": provenance()}
    logger.info("%s", header(report).strip())
    return _write_report(run(report, out), out)


def _write_report(report: dict, out: Path) -> int:
    report["results"] = summarize(report["runs"])
    report["ratios"] = ratios(report)
    (out / "accumulation.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "accumulation.md").write_text(header(report) + markdown(report) + "\n")
    plot(report, out / "accumulation.png")
    logger.info("\n%s", markdown(report))
    logger.info("wrote %s/accumulation.json, accumulation.md, accumulation.png", out)
    return 0
