"""What each ``<!-- results: NAME -->`` block says, written from the stored JSON only.

A section reads the files it cites through :class:`~zeropp_tools.results.render.StoredResults`
(one clean commit per block) and returns markdown. The quick tier (``quick/``) holds the
README's figures; the full tier (``full/``) the longer studies, and a section whose study has
not run at a clean commit says so instead of quoting older figures. One block computes from
published constants alone (``simulator-paper-implied``: what the ZeRO++ blog's figures imply),
so it cites no run.
"""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Callable

from zeropp_tools import dryrun
from zeropp_tools.bench import accumulation, rlhf, throughput
from zeropp_tools.bench.comm import format_report
from zeropp_tools.bench.memory_report import markdown as memory_markdown
from zeropp_tools.plan import comparison_markdown
from zeropp_tools.results.tiers import FULL, QUICK
from zeropp_tools.simulation import paper
from zeropp_tools.simulation.compare import simulated_markdown
from zeropp_tools.study import convergence


def _label(bandwidth: str) -> str:
    return "unshaped" if bandwidth in ("none", "unshaped") else f"{bandwidth} Mbit/s"


def _bullet(text: str) -> str:
    """One list item wrapped as the README's lines are."""
    return textwrap.fill(text, width=94, subsequent_indent="  ", break_on_hyphens=False)


def _command(report: dict) -> str:
    """The command that measured ``report``, without its output folder (a path on that machine)."""
    words = shlex.split(report.get("provenance", report)["command"])
    if "--out" in words:
        index = words.index("--out")
        del words[index:index + 2]
    return shlex.join(words)


def _without_title(markdown: str) -> str:
    """A report's markdown less its title and the blank line after it: the page has its own."""
    return markdown.split("\n", 2)[2]


def _source(report: dict) -> str:
    source = report.get("provenance", report)
    return (f"commit {source['git_commit'][:7]}, {_machine(report)}, {source['machine']['cores']} cores, "
            f"{source['cpu_capability']}")


def bytes_bullet(results) -> str:
    report = results.load(f"{QUICK}/comm.json")
    ratios = {layout: rows["zero++"] for layout, rows in report["layouts"].items()}
    exact = all(row["measured"] == row["predicted"] for rows in report["layouts"].values() for row in rows.values())
    first, *others = [f"{row['inter_node_vs_zero3']:.3f}x" + (" of ZeRO-3's bytes per step" if index == 0 else "")
                      + f" on {layout}" for index, (layout, row) in enumerate(ratios.items())]
    layouts = " and ".join([first, *others])
    agreement = "equal to" if exact else "not equal to"
    return _bullet(f"- **Bytes**: with qwZ + hpZ + qgZ a node's link carries {layouts}, "
                   f"{agreement} the analytic prediction ({_source(report)}; [bytes](docs/results/bytes.md)).")


NOT_YET_RUN = "Not yet run at one clean commit: `make results-full` runs it, and this table is then written from it."
FULL_THROUGHPUT = f"{FULL}/throughput/throughput.json"
# Auto mode's runs: 100 steps at the faster links (its trials take up to 32), 30 at 50 Mbit/s.
AUTO_RUNS = (f"{FULL}/auto/throughput.json", f"{FULL}/auto_50/throughput.json")


def throughput_bullet(results) -> str:
    """The README's throughput line: from the full tier's matrix once it has run at a clean
    commit (every fixed scheme, both set-ups of each peer), else from the quick tier."""
    report = results.load(FULL_THROUGHPUT if results.exists(FULL_THROUGHPUT) else f"{QUICK}/throughput/throughput.json")
    ratios = report["ratios"]
    slowest = min(ratios, key=lambda bandwidth: float("inf") if bandwidth == "none" else float(bandwidth))
    peers = ratios[slowest]
    figures = "; ".join(f"{_label(bandwidth)} {entry['zero++_vs_zero3']:.2f}x"
                        for bandwidth, entry in ratios.items() if bandwidth != slowest)
    return _bullet(f"- **Throughput** (medians of {report['repetitions']} interleaved runs, "
                   f"{report['precision']['compute_dtype']}): at {_label(slowest)} ZeRO++ trains at "
                   f"{peers['zero++_vs_zero3']:.2f}x ZeRO-3's tokens/s, {peers['zero++_vs_best_fsdp2']:.2f}x FSDP2 "
                   f"HSDP's and {peers['zero++_vs_best_deepspeed']:.2f}x DeepSpeed ZeRO++'s; against ZeRO-3 "
                   f"{figures}{_auto_clause(results)} ({_source(report)}; [throughput](docs/results/throughput.md)).")


def _auto_clause(results) -> str:
    """Auto mode against the best scheme it can choose, per link, once its runs exist."""
    if not results.exists(FULL_THROUGHPUT) or not all(results.exists(path) for path in AUTO_RUNS):
        return ""
    matrix_machine = _machine(results.load(FULL_THROUGHPUT))
    figures = []
    for path in AUTO_RUNS:
        report = results.load(path)
        # Each auto run holds its own fixed schemes, so its ratios stand on its machine; a
        # machine other than the matrix's is named beside them.
        elsewhere = "" if _machine(report) == matrix_machine else f" (on {_machine(report)})"
        figures += [f"{_label(bandwidth)} {entry['auto_vs_best_fixed']:.2f}x{elsewhere}"
                    for bandwidth, entry in report["ratios"].items()]
    return "; auto mode " + ", ".join(figures) + " of the best scheme it can choose"


def _machine(report: dict) -> str:
    return report.get("provenance", report)["machine"]["cpu_model"].replace("(R)", "").replace(" Processor", "")


def accumulation_bullet(results) -> str:
    report = results.load(f"{QUICK}/accumulation/accumulation.json")
    k = max(report["accumulations"])
    cells = {bandwidth: report["ratios"][f"{bandwidth}/{k}"] for bandwidth in report["bandwidths"]}
    limits = ", ".join(f"{entry['vs_limit']:.2f}x the unshaped limit at {_label(bandwidth)}"
                       for bandwidth, entry in cells.items())
    every = ", ".join(f"{entry['vs_every_micro_step']:.2f}x" for entry in cells.values())
    peers = [value for entry in cells.values() for name, value in entry.items()
             if name.startswith(("vs_deepspeed", "vs_fsdp2"))]
    return _bullet(f"- **Accumulation**: with `model.no_sync()` gradients cross nodes once per optimizer step; "
                   f"at k = {k}, {limits}; {every} of reducing every micro-step, {min(peers):.2f}-{max(peers):.2f}x "
                   f"the peers' own accumulation ({_source(report)}; [accumulation](docs/results/accumulation.md)).")


def accumulation_kept_bullet(results) -> str:
    """The same with weight deltas and the weights kept between micro-steps (the limit kept alike)."""
    report = results.load("accumulation_kept/accumulation.json")
    k = max(report["accumulations"])
    cells = {bandwidth: accumulation.ratios(report, "deltas")[f"{bandwidth}/{k}"] for bandwidth in report["bandwidths"]}
    limits = ", ".join(f"{entry['vs_limit']:.2f}x" for entry in cells.values())
    every = ", ".join(f"{entry['vs_every_micro_step']:.2f}x" for entry in cells.values())
    peers = [value for entry in cells.values() for name, value in entry.items()
             if name.startswith(("vs_deepspeed", "vs_fsdp2"))]
    bandwidths = " / ".join(cells) + " Mbit/s"
    return _bullet(f"- **Weights kept** between micro-steps (and weight deltas), {bandwidths}: {limits} the limit "
                   f"kept alike; {every} of reducing every micro-step; {min(peers):.2f}-{max(peers):.2f}x the peers "
                   f"({_source(report)}).")


def memory_bullet(results) -> str:
    report = results.load(f"{QUICK}/memory/memory.json")
    fixed = report["fixed"]
    ours, fsdp2 = max(fixed["zeropp-zero3"]["peak_rss_bytes"]), max(fixed["fsdp2"]["peak_rss_bytes"])
    parameters = fixed["zeropp-zero3"]["parameters"]
    return _bullet(f"- **Memory**: ZeRO-3 peaks at {ours / 1e9:.2f} GB per rank where FSDP2 takes "
                   f"{fsdp2 / 1e9:.2f} GB ({ours / fsdp2:.2f}x) on a {parameters / 1e6:.0f}M-parameter model at "
                   f"4 ranks ({_source(report)}; [memory](docs/results/memory.md)).")


def _not_yet(what: str, page: str, link: str) -> str:
    return _bullet(f"- **{what}**: not yet measured at a clean commit; the full tier (`make results-full`) "
                   f"runs it ([{link}]({page})).")


def convergence_bullet(results) -> str:
    if not results.exists(f"{FULL}/convergence/summary.json"):
        return _not_yet("Convergence (10 seeds)", "docs/results/convergence.md", "convergence")
    report = results.load(f"{FULL}/convergence/summary.json")
    # The names without their formats, which the linked page's table gives.
    gaps = ", ".join(f"{name.split(' (')[0]} {row['mean_gap_percent']:+.2f}% ± {row['gap_standard_error']:.2f}"
                     for name, row in report["runs"].items() if name != "zero3" and row["gap_standard_error"])
    return _bullet(f"- **Convergence**: final validation loss against ZeRO-3's over {len(report['seeds'])} seeds "
                   f"(mean gap ± standard error): {gaps}; ZeRO-3's own spread over the seeds "
                   f"{report['noise_band_percent']:.2f}% ({_source(report)}; [convergence](docs/results/convergence.md)).")


def convergence_table(results) -> str:
    """The ten-seed study's table, its noise band and the plot, or why there is none yet."""
    path = f"{FULL}/convergence/summary.json"
    if not results.exists(path):
        return ("Not yet run at one clean commit: the full tier (`make results-full`) runs it, and this "
                "table is then written from its `summary.json`.")
    report = results.load(path)
    return (f"`{_command(report)}`, {_source(report)}; {len(report['seeds'])} seeds per variant.\n\n"
            + convergence.markdown(report)
            + "\n\n![Validation loss and paired gap to ZeRO-3 over the seeds]"
              "(../../benchmarks/results/full/convergence/convergence.png)")


def bytes_table(results) -> str:
    report = results.load(f"{QUICK}/comm.json")
    return f"`{_command(report)}`, {_source(report)}:\n\n```\n{format_report(report)}\n```"


def throughput_table(results) -> str:
    return _throughput_markdown(results.load(f"{QUICK}/throughput/throughput.json"))


def _throughput_markdown(report: dict) -> str:
    """A throughput report's header, table and ratios."""
    return (throughput.header(report) + throughput.markdown(report) + "\n\n"
            + throughput.ratios_markdown(report["ratios"]))


def throughput_full(results) -> str:
    """The full tier's matrix: every fixed scheme and both set-ups of each peer at every link."""
    if not results.exists(FULL_THROUGHPUT):
        return NOT_YET_RUN
    return _throughput_markdown(results.load(FULL_THROUGHPUT))


def throughput_auto(results) -> str:
    """Auto mode beside every scheme it can choose, held to the best of them, per link."""
    if not all(results.exists(path) for path in AUTO_RUNS):
        return NOT_YET_RUN
    lines = ["| link | auto mode, tokens/s | ran | best scheme it can choose | its tokens/s | auto / best |",
             "|---|---|---|---|---|---|"]
    headers = []
    for path in AUTO_RUNS:
        report = results.load(path)
        links = ", ".join(_label(bandwidth) for bandwidth in report["ratios"])
        headers.append(f"{links[0].upper()}{links[1:]}: {throughput.header(report).strip()}")
        for bandwidth, entry in report["ratios"].items():
            row = report["results"][bandwidth]
            auto, best = row["auto"], row[entry["best_fixed"]]
            ran = auto["auto_decisions"][-1]["choice"] if auto.get("auto_decisions") else "-"
            lines.append(f"| {_label(bandwidth)} | {auto['tokens_per_s']:,.0f} | {ran} | {entry['best_fixed']} | "
                         f"{best['tokens_per_s']:,.0f} | {entry['auto_vs_best_fixed']:.2f}x |")
    return "\n\n".join(headers) + "\n\n" + "\n".join(lines)


def throughput_planner(results) -> str:
    report = results.load(f"{QUICK}/throughput/throughput.json")
    return comparison_markdown(report["planner"])


def accumulation_table(results) -> str:
    report = results.load(f"{QUICK}/accumulation/accumulation.json")
    return accumulation.header(report) + accumulation.markdown(report)


def accumulation_study(results) -> str:
    """The full accumulation study (k = 1, 4, 8), from its own clean commit."""
    report = results.load("accumulation/accumulation.json")
    return accumulation.header(report) + accumulation.markdown(report)


def accumulation_kept(results) -> str:
    """The accumulation with every unit kept gathered between micro-steps, from its own clean commit."""
    report = results.load("accumulation_kept/accumulation.json")
    return (accumulation.header(report) + accumulation.markdown(report) + "\n\n"
            + accumulation.ratios_markdown(report, "deltas") + "\n\n"
            + accumulation.link_only_markdown(report, "50", 8, accumulation.EVERY_MICRO_STEP, "deltas"))


def accumulation_memory(results) -> str:
    """Peak memory per rank beside tokens/s, with and without the weights kept: two runs."""
    lines = ["| run | cell | tokens/s, median [min-max] | peak resident growth per rank (MB) |",
             "|---|---|---|---|"]
    sources = []
    for label in ("default", "kept"):
        report = results.load(f"accumulation_memory/{label}/accumulation.json")
        sources.append(f"`{_command(report)}` ({_source(report)})")
        for key, cell in report["results"].items():
            bandwidth, k, variant = key.split("/")
            runs = cell["tokens_per_s_runs"]
            where = "unshaped (limit)" if bandwidth == "none" else f"{bandwidth} Mbit/s"
            lines.append(f"| {label} | {variant}, k = {k}, {where} | {cell['tokens_per_s']:,.0f} [{runs[0]:,.0f}-{runs[-1]:,.0f}] "
                         f"| {cell['peak_rss_increase_bytes'] / 1e6:,.0f} |")
    return "; then ".join(sources) + ":\n\n" + "\n".join(lines)


def accumulation_bound(results) -> str:
    """How close the delta run at 50 Mbit/s comes to the fastest any exact schedule could be."""
    report = results.load("accumulation_deltas/accumulation.json")
    return f"{_source(report)}: " + accumulation.bound_markdown(report, "50", 8, "deltas")


def memory_table(results) -> str:
    report = results.load(f"{QUICK}/memory/memory.json")
    return _without_title(memory_markdown(report))


def memory_study(results) -> str:
    """The memory study with its search for the largest model, from its own clean commit."""
    report = results.load("memory/memory.json")
    return _without_title(memory_markdown(report))


def dryrun_table(results) -> str:
    report = results.load("dryrun/dryrun.json")
    return _without_title(dryrun.markdown(report))


def rlhf_table(results) -> str:
    report = results.load("rlhf/rlhf.json")
    return f"{_source(report)}, medians of the repetitions:\n\n" + rlhf.ratios_markdown(report["ratios"])


def simulator_paper(results, name: str = "paper", listed_only: bool = False) -> str:
    """The paper's rows simulated on the V100 description, beside the published figures."""
    report = results.load(f"simulator/{name}.json")
    summary = report["summary"]
    shown = "the 18B rows it is held to" if listed_only else "every row"
    return (f"`{_command(report)}`, {_source(report)}; of the {summary['rows']} 18B rows it is held to, "
            f"{summary['tflops_within_15_percent']} with both TFLOP/s within 15% and {summary['speedup_within_10_percent']} "
            f"with the speedup within 10%; of the blog's {summary['other_rows']} other rows, "
            f"{summary['other_tflops_within_15_percent']} and {summary['other_speedup_within_10_percent']}. "
            f"Shown: {shown}.\n\n" + paper.paper_markdown(report, listed_only))


def _base_latency(calibration: dict) -> str:
    """The skew of a collective after compute (a base latency per collective in
    calibrations before the skew had its own field; none before the probe after compute)."""
    if "arrival_skew_s" in calibration:
        return (f", {calibration['arrival_skew_s'] * 1e3:.2f} ms of arrival skew for a collective after compute, "
                f"received bytes copied by the cores at {calibration['host_receive_intra_node_bytes_per_s'] / 1e6:,.0f}"
                f" / {calibration['host_receive_inter_node_bytes_per_s'] / 1e6:,.0f} MB/s inside / across nodes")
    base = calibration["base_latency_s"]
    return f" plus {base * 1e3:.2f} ms per collective after compute" if base > 0 else ""


def _parallel_flows(rates: dict) -> str:
    """The rate with a flow per rank across the link (calibrations before it have none)."""
    parallel = rates.get("parallel_flows_adapter_bytes_per_s")
    return f" ({parallel * 8 / 1e6:,.0f} with a flow per rank)" if parallel else ""


def simulator_cluster(results) -> str:
    """Each fixed scheme's recorded schedule replayed on the calibrated emulated cluster."""
    report = results.load("simulator/throughput/throughput.json")
    calibration = report["calibration"]
    inputs = (f"Calibration (measured before the runs, the same commit): {calibration['sustained_flops'] / 1e9:.1f} "
              f"GFLOP/s per rank, compute slowed {calibration['slowdown_during_communication'] * 100:.0f}% beside "
              f"communication, {calibration['intra_node_bytes_per_s'] / 1e6:,.0f} MB/s inside a node, "
              f"{calibration['adapter_bytes_per_s'] * 8 / 1e6:,.0f} Mbit/s between nodes unshaped"
              f"{_parallel_flows(calibration)}, latency "
              f"{calibration['intra_node_step_latency_s'] * 1e3:.2f} / {calibration['inter_node_step_latency_s'] * 1e3:.2f} "
              f"ms per step inside / across nodes{_base_latency(calibration)}, kernels "
              f"{calibration['kernel_bytes_per_s'] / 1e9:.1f} GB/s.")
    probes = report.get("link_probes")
    if probes:
        carried = [f"{bandwidth} Mbit/s carries {probe['adapter_bytes_per_s'] * 8 / 1e6:,.0f} Mbit/s of payload"
                   + _parallel_flows(probe) for bandwidth, probe in probes.items()]
        inputs += " Shaped links, probed the same way: " + ", ".join(carried) + "."
    return (f"{throughput.header(report)}{_bullet(inputs)}\n\n" + simulated_markdown(report["simulator"]))


SECTIONS: dict[str, Callable] = {
    "bytes": bytes_bullet,
    "throughput": throughput_bullet,
    "accumulation": accumulation_bullet,
    "accumulation-kept-bullet": accumulation_kept_bullet,
    "memory": memory_bullet,
    "convergence": convergence_bullet,
    "convergence-table": convergence_table,
    "bytes-table": bytes_table,
    "throughput-table": throughput_table,
    "throughput-planner": throughput_planner,
    "throughput-full": throughput_full,
    "throughput-auto": throughput_auto,
    "accumulation-table": accumulation_table,
    "accumulation-study": accumulation_study,
    "accumulation-bound": accumulation_bound,
    "accumulation-kept": accumulation_kept,
    "accumulation-memory": accumulation_memory,
    "memory-table": memory_table,
    "memory-study": memory_study,
    "dryrun-table": dryrun_table,
    "rlhf-table": rlhf_table,
    "simulator-paper": simulator_paper,
    "simulator-paper-no-prefetch": lambda results: simulator_paper(results, "paper-no-prefetch", listed_only=True),
    "simulator-paper-implied": lambda results: paper.implied_markdown(paper.implied_by_published()),
    "simulator-cluster": simulator_cluster,
}
