"""The markdown table and the plot of ``zeropp bench memory``."""

from __future__ import annotations

from pathlib import Path


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def markdown(report: dict) -> str:
    source = report["provenance"]
    machine = source["machine"]
    lines = [
        f"# Peak memory per rank: {report['world_size']} CPU ranks as 2 nodes x {report['ranks_per_node']}",
        "",
        f"Commit {source['git_commit']}, {machine['cpu_model']} ({machine['cores']} cores, flags "
        f"{', '.join(machine['cpu_flags']) or 'none'}), torch {source['torch']}, fp32, "
        f"AdamW over model.parameters(), 1 x 64 tokens per rank, 3 steps.",
        "",
        "## One fixed model",
        "",
        "| engine | parameters | peak RSS per rank (largest rank) | peak live tensors per rank | vs FSDP2 (RSS) |",
        "|---|---|---|---|---|",
    ]
    fixed = report["fixed"]
    fsdp2 = max(fixed["fsdp2"]["peak_rss_bytes"]) if "peak_rss_bytes" in fixed.get("fsdp2", {}) else None
    for engine, result in fixed.items():
        if "peak_rss_bytes" not in result:
            lines.append(f"| {engine} | - | {result.get('skipped', 'failed')} | - | - |")
            continue
        peak = max(result["peak_rss_bytes"])
        ratio = f"{peak / fsdp2:.2f}x" if fsdp2 else "-"
        lines.append(f"| {engine} | {result['parameters'] / 1e6:.0f}M | {_gb(peak)} | "
                     f"{_gb(max(result['peak_live_bytes']))} | {ratio} |")
    if report["search"]:
        lines += ["", f"## The largest model within {_gb(report['budget_bytes'])} "
                      f"({report['budget_bytes'] / report['total_ram_bytes']:.0%} of RAM, four ranks together)", "",
                  "| engine | largest model trained | its peak RSS, 4 processes | one layer more (predicted) | runs |",
                  "|---|---|---|---|---|"]
        for engine, found in report["search"].items():
            best = found["largest"]
            if best is None:
                lines.append(f"| {engine} | none within the budget | - | - | {len(found['runs'])} |")
                continue
            lines.append(f"| {engine} | {best['parameters'] / 1e6:.0f}M ({best['layers']} layers) | "
                         f"{_gb(sum(best['peak_rss_bytes']) + sum(best['baseline_rss_bytes']))} | {_gb(found['next_size_predicted_total_bytes'])} | "
                         f"{len(found['runs'])} |")
    lines += ["", "Reproduce: `" + " ".join(["zeropp bench memory", *_flags(report["arguments"])]) + "`", ""]
    return "\n".join(lines)


def _flags(arguments: dict) -> list[str]:
    flags = []
    for name in ("engines", "hidden", "layers", "ram_fraction"):
        flags.append(f"--{name.replace('_', '-')} {arguments[name]}")
    if arguments.get("no_search"):
        flags.append("--no-search")
    return flags


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    runs: dict[str, list[dict]] = {}
    for result in report["fixed"].values():
        if "peak_rss_bytes" in result:
            runs.setdefault(result["engine"], []).append(result)
    for found in report["search"].values():
        runs.setdefault(found["engine"], []).extend(found["runs"])
    for engine, results in runs.items():
        points = sorted({(run["parameters"], max(run["peak_rss_bytes"])) for run in results})
        axes.plot([p / 1e6 for p, _ in points], [m / 1e9 for _, m in points], marker="o", label=engine)
    axes.axhline(report["budget_bytes"] / report["world_size"] / 1e9, color="grey", linestyle="--",
                 label="search budget per rank")
    axes.set_xlabel("parameters (millions)")
    axes.set_ylabel("peak RSS per rank (GB)")
    axes.set_title("Peak memory per rank, 4 CPU ranks, AdamW, fp32")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(report: dict, out: Path) -> None:
    (out / "memory.md").write_text(markdown(report))
    plot(report, out / "memory.png")
