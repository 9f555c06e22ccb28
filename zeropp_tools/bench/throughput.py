"""``zeropp bench throughput``: tokens/s of ZeRO-3 and the ZeRO++ variants on an emulated
cluster whose inter-node links are shaped to several bandwidths.

    zeropp bench throughput                                   # 2 nodes x 2, GPT small, bf16
    zeropp bench throughput --bandwidths none,200 --variants zero3,zero++ --steps 12

Each (bandwidth, variant) is one ``zeropp train`` over ``zeropp cluster``: tokens/s is the
median of rank 0's step times after 5 warm-up steps (every step ends in a collective, so
the ranks finish together); exposed communication is
the time rank 0 spent blocked in collectives; cross-node bytes come from the accounting
and from node 0's link counters. Writes JSON, a markdown table and a plot.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.emulated import payload_bytes
from zeropp_tools.cluster.runner import run_on_cluster
from zeropp_tools.plan import compare, comparison_markdown

logger = logging.getLogger(__name__)


VARIANTS = {
    "zero3": [],
    "qwz": ["--qwz"],
    "hpz": ["--hpz", "{ranks_per_node}"],
    "qgz": ["--qgz"],
    "zero++": ["--qwz", "--hpz", "{ranks_per_node}", "--qgz"],
}


def _bandwidth(text: str) -> float | None:
    return None if text in ("none", "unshaped") else float(text)


def _run(spec: ClusterSpec, variant: str, arguments: list[str], out: Path, **launch) -> tuple[dict, dict]:
    """One run over the cluster: (rank 0's summary.json, the cluster's result)."""
    result = run_on_cluster(spec, arguments, timeout_s=1800, **launch)
    if result["exit_codes"] != [0] * spec.num_nodes:
        raise RuntimeError(f"{variant} at {spec.bandwidth_mbit} Mbit/s failed; logs in {result['logs']}")
    return json.loads((out / "summary.json").read_text()), result


def _link_figures(result: dict) -> dict:
    """What node 0's link carried in, raw and as payload, and the TCP segments resent."""
    return {
        "node0_link_rx_bytes": result["link_bytes"][0]["rx_bytes"],
        "node0_link_rx_payload_bytes": payload_bytes(result["link_bytes"][0]),
        "tcp_retransmitted_segments": sum(node["tcp_retransmitted_segments"] for node in result["link_bytes"]),
    }


def measure(spec: ClusterSpec, variant: str, train_arguments: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="zeropp-throughput-"))
    extra = [a.format(ranks_per_node=spec.ranks_per_node) for a in VARIANTS[variant]]
    summary, result = _run(spec, variant, ["train", *train_arguments, *extra, "--out", str(out)], out)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step_inter = sum(row["received_inter_node"] for row in steps[-1]["comm"].values())
    node0_accounted = sum(summary["comm_total_by_rank"][r]["received_inter_node"] for r in range(spec.ranks_per_node))
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "median_step_s": summary["median_step_s"],
        "median_exposed_comm_s": summary["median_exposed_comm_s"],
        "exposed_fraction": summary["median_exposed_comm_s"] / summary["median_step_s"],
        "rank0_inter_node_bytes_per_step": per_step_inter,
        **_link_figures(result),
        "node0_accounted_rx_bytes": node0_accounted,
        "final_train_loss": summary["final_train_loss"],
    }


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DEEPSPEED_PYTHON = Path(__file__).resolve().parents[2] / ".venv-deepspeed" / "bin" / "python"
# Peers on the same cluster and work: variant -> (script in benchmarks/, its --variant).
PEERS = {
    "fsdp2": ("fsdp2_train.py", "plain"),
    "fsdp2-reshard-node": ("fsdp2_train.py", "reshard-node"),
    "fsdp2-hsdp": ("fsdp2_train.py", "hsdp"),
    "deepspeed-zero3": ("deepspeed_train.py", "zero3"),
    "deepspeed-zero++": ("deepspeed_train.py", "zero++"),
}


def measure_peer(spec: ClusterSpec, variant: str, train_arguments: list[str]) -> dict:
    """FSDP2 or DeepSpeed on the same cluster and work (no accounting: link counters only).
    DeepSpeed runs from its own environment (``make deepspeed-setup``)."""
    script, flavour = PEERS[variant]
    out = Path(tempfile.mkdtemp(prefix=f"zeropp-{variant}-"))
    launch = {"program": [str(BENCHMARKS / script)]}
    if variant.startswith("deepspeed"):
        if not DEEPSPEED_PYTHON.exists():
            raise RuntimeError(f"{variant} needs DeepSpeed's separate environment: run `make deepspeed-setup` first")
        launch.update(python=str(DEEPSPEED_PYTHON),
                      environment={"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(spec.ranks_per_node)})
    summary, result = _run(spec, variant, [*train_arguments, "--variant", flavour, "--out", str(out)], out, **launch)
    measured = {
        "tokens_per_s": summary["tokens_per_s"],
        "median_step_s": summary["median_step_s"],
        **_link_figures(result),
        "final_train_loss": summary["losses"][-1],
    }
    if "stand_in_quantizer_calls" in summary:
        measured["stand_in_quantizer_calls"] = summary["stand_in_quantizer_calls"]
    return measured


def run(nodes: int, ranks_per_node: int, bandwidths: list[str], variants: list[str], train_arguments: list[str],
        out: Path) -> dict:
    """Measures every (bandwidth, variant); the JSON is rewritten after each run, and a failed
    run is recorded with its logs instead of ending the benchmark."""
    report = {"layout": f"{nodes}x{ranks_per_node}", "train_arguments": train_arguments, "results": {}}
    for text in bandwidths:
        spec = ClusterSpec(nodes, ranks_per_node, _bandwidth(text))
        row = report["results"].setdefault(text, {})
        for variant in variants:
            try:
                if variant in PEERS:
                    row[variant] = measure_peer(spec, variant, train_arguments)
                else:
                    row[variant] = measure(spec, variant, train_arguments)
            except RuntimeError as error:
                row[variant] = {"error": str(error)}
                logger.info(f"{text:>9} Mbit/s {variant:<20} FAILED: {error}")
                continue
            finally:
                (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
            exposed = row[variant].get("exposed_fraction")
            logger.info(f"{text:>9} Mbit/s {variant:<20} {row[variant]['tokens_per_s']:>10,.0f} tokens/s"
                  + (f", exposed comm {exposed:.0%}" if exposed is not None else ""))
        baseline = row.get("zero3", {}).get("tokens_per_s")
        for result in row.values():
            if "tokens_per_s" in result and baseline:
                result["speedup_vs_zero3"] = result["tokens_per_s"] / baseline
    return report


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
            cells.append(f"{r['tokens_per_s']:,.0f}{speedup}{exposed}")
        label = "unshaped" if _bandwidth(bandwidth) is None else bandwidth
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = list(report["results"])
    variants = list(report["results"][bandwidths[0]])
    labels = ["unshaped" if _bandwidth(b) is None else b for b in bandwidths]
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for variant in variants:
        points = [(label, report["results"][b][variant].get("tokens_per_s")) for b, label in zip(bandwidths, labels)]
        points = [(label, v) for label, v in points if v is not None]
        style = "o-" if variant in VARIANTS else "s--"  # zeropp solid, peers dashed
        axis.plot([label for label, _ in points], [v for _, v in points], style, label=variant)
    axis.set_yscale("log")
    axis.set_xlabel("inter-node bandwidth per node (Mbit/s)")
    axis.set_ylabel("tokens/s (log scale)")
    axis.set_title(f"GPT on an emulated {report['layout']} cluster")
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(args) -> int:
    train_arguments = ["--model", args.model, "--steps", str(args.steps), "--batch-per-rank", str(args.batch_per_rank),
                       "--seq-len", str(args.seq_len), "--precision", args.precision]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS and v not in PEERS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed values: {[*VARIANTS, *PEERS]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(args.nodes, args.ranks_per_node, args.bandwidths.split(","), variants, train_arguments, out)
    report["planner"] = compare(report)  # the planner's step times against these measurements
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "throughput.md").write_text(markdown(report) + "\n\n" + comparison_markdown(report["planner"]) + "\n")
    plot(report, out / "throughput.png")
    logger.info(markdown(report))
    logger.info(comparison_markdown(report["planner"]))
    logger.info(f"wrote {out}/throughput.json, throughput.md, throughput.png")
    return 0
