"""``zeropp study convergence``: does the model learn as well under compressed communication?

    zeropp study convergence --out runs/convergence          # ~6 minutes per run on 2 CPU cores
    zeropp study convergence --layout 4x1 --variants zero3,zero++,deltas --out runs/convergence_4x1

Trains the GPT on the standard-library corpus, by default 4 ranks as 2 nodes x 2, under
ZeRO-3 and each compressed variant. The main variants run once per seed, and every seed gives ZeRO-3 and the
variant the same initial weights and data order, so each gap is read as a paired difference
(variant minus ZeRO-3 at the same seed); ZeRO-3's spread over seeds is the noise band.
Extra variants run at the first seed only. Each finished run leaves
``<run>.summary.json``; running the study again skips those, so an interrupted study resumes.
Writes each run's metrics (JSON lines), a plot of validation loss per variant and of its
paired gap to ZeRO-3, and a table (markdown and JSON).
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import replace
from pathlib import Path

from zeropp.config import ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp_tools.plan import ClusterModel, gpt_work, predict
from zeropp.train import TrainConfig, train
from zeropp_tools.bench.provenance import chosen_precision, provenance
from zeropp_tools.bench.comm import parse_layout
from zeropp_tools.schemes import named_schemes

logger = logging.getLogger(__name__)


BASELINE = "zero3"
ZERO_PP_NAME = "zero++ (int8 w, int4/int4 g)"
LOG_GRID_NAME = "ours + log grid (int12 w, int8/log4 g)"
DELTAS_NAME = "ours + weight deltas (int3 changes, int8/log4 g)"
ZERO_PP_LOG_GRID_NAME = "zero++ + log grid (int8 w, int8/log4 g)"
# --variants keys of the main variants
VARIANT_KEYS = {"zero3": BASELINE, "zero++": ZERO_PP_NAME, "two-hop": "ours (two-hop int12 w, int8/int4 g)",
                "log-grid": LOG_GRID_NAME, "deltas": DELTAS_NAME, "zero++-log-grid": ZERO_PP_LOG_GRID_NAME}
DEFAULT_WORLD_SIZE = 4  # studies before --layout ran 2 nodes x 2
# ZeroConfig fields renamed since stored summaries were written: old name -> new name
RENAMED_FIELDS = {"hierarchical_weight_gather": "two_hop_weight_gather"}


def _variants(steps: int, ranks_per_node: int = 2) -> tuple[dict[str, ZeroConfig], dict[str, ZeroConfig]]:
    """(main variants, run at every seed; extra variants, run at the first seed). hpZ spans
    the node."""
    schemes = named_schemes(ranks_per_node)
    ZERO_PP = schemes["zero++"]
    TWO_HOP = dict(schemes["zero++-two-hop"], gradient_bits_intra_node=8)
    main = {
        BASELINE: ZeroConfig(**schemes["zero3"]),
        ZERO_PP_NAME: ZeroConfig(**ZERO_PP),
        # The two-hop gather brings W - D shards over each node's link instead of the ring's
        # W - 1 (2 instead of 3 on 2 x 2) and this node's shards exact; the bytes it saves
        # pay for 12 instead of 8 bits on the other nodes' shards.
        "ours (two-hop int12 w, int8/int4 g)": ZeroConfig(**TWO_HOP, weight_bits=12),
        # The same 4 bits across nodes on a grid of powers of two: Adam divides each value by
        # its own running scale, so what it needs is every value to within a fraction of its
        # size, which a uniform grid denies the small ones.
        LOG_GRID_NAME: ZeroConfig(**schemes["log-grid"]),
        # The log grid's gradients with ZeRO++'s ring INT8 weights: if the gradients are
        # where ZeRO++ loses, this is the same quality at ZeRO++'s bytes and speed.
        ZERO_PP_LOG_GRID_NAME: ZeroConfig(**schemes["zero++-log-grid"]),
        # Weights change little per step, and each node already holds last step's: send the
        # change only, at 3 bits (what rounding drops is in the next change), with the log
        # grid's gradients. Under half of ZeRO++'s bytes on 2 x 2 and 4 x 1.
        DELTAS_NAME: ZeroConfig(**schemes["deltas"]),
    }
    extra = {
        # Deterministic rounding sends every gradient value under half a step to zero, so
        # Adam's average of a small but steady gradient shrinks; these two keep it unbiased:
        # rounding at random in proportion, or carrying each rank's rounding error into its
        # next step.
        "ours + stochastic rounding": ZeroConfig(**TWO_HOP, weight_bits=12, gradient_stochastic_rounding=True),
        "ours + error feedback": ZeroConfig(**TWO_HOP, weight_bits=12, gradient_error_feedback=True),
        "zero++ with int8/int4 g": ZeroConfig(**schemes["zero++-int8-intra-gradients"]),
        # The same saving spent on the gradients (INT8 across nodes); on the gradients for
        # the first half of the run and on the weights for the second.
        "two-hop int8 w, int8/int8 g": ZeroConfig(**TWO_HOP, gradient_bits_inter_node=8),
        "two-hop int8 w + int8/int8 g, then int12 w + int8/int4 g": ZeroConfig(
            **TWO_HOP, gradient_bits_inter_node=8, late_bits_from_step=steps // 2,
            late_weight_bits=12, late_gradient_bits_inter_node=4,
        ),
        "zero++ with int4 weights": ZeroConfig(**ZERO_PP, weight_bits=4),
        # hpZ changes no numbers, so these two split ZeRO++'s gap between weights and gradients.
        "qwZ only (int8 w)": ZeroConfig(quantized_weights=True),
        "qgZ only (int4/int4 g)": ZeroConfig(quantized_gradients=True),
        # About 1% error per step on the gradients and nothing else: how far a run drifts
        # from ZeRO-3 when the perturbation is small.
        "qgZ only (int8/int8 g)": ZeroConfig(
            quantized_gradients=True, gradient_bits_intra_node=8, gradient_bits_inter_node=8
        ),
    }
    return main, extra


def _run_name(name: str, seed: int) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_") + f"_seed{seed}"


def _runs(seeds: list[int], base: "TrainConfig", variants: list[str] | None,
          compute_dtype: str = "fp32") -> list[tuple[str, int, ZeroConfig]]:
    """Every run of the study: all main variants at every seed and the extras at the first,
    or only the ``variants`` (keys of :data:`VARIANT_KEYS`) at every seed; all of them
    computing in ``compute_dtype``."""
    main, extra = _variants(base.steps, base.ranks_per_node)
    if variants is not None:
        runs = [(VARIANT_KEYS[key], seed, main[VARIANT_KEYS[key]]) for seed in seeds for key in variants]
    else:
        runs = [(name, seed, zero) for seed in seeds for name, zero in main.items()]
        runs += [(name, seeds[0], zero) for name, zero in extra.items()]
    return [(name, seed, replace(zero, compute_dtype=compute_dtype)) for name, seed, zero in runs]


def _run_once(base: TrainConfig, out: Path, name: str, seed: int, zero: ZeroConfig, world_size: int) -> dict:
    """Train one run, or read the summary a previous study left for it."""
    summary_path = out / f"{_run_name(name, seed)}.summary.json"
    if summary_path.exists():
        logger.info(f"{name}, seed {seed}: finished earlier, reusing {summary_path}")
        return json.loads(summary_path.read_text())
    config = replace(base, seed=seed, zero=zero, metrics_path=str(out / f"{_run_name(name, seed)}.jsonl"))
    summary = spawn_ranks(train, world_size, (config,), timeout_s=6 * 3600)[0]
    kept = {"validation_loss": summary["validation_loss"], "tokens_per_s": summary["tokens_per_s"],
            "config": summary["config"], "world_size": world_size, "provenance": provenance(),
            "resting_bytes_per_rank": summary["resting_bytes_per_rank"]}
    summary_path.write_text(json.dumps(kept, indent=2) + "\n")
    logger.info(f"{name}, seed {seed}: final validation loss {kept['validation_loss']:.4f} "
          f"({kept['tokens_per_s']:,.0f} tokens/s)")
    return kept


def run_study(base: TrainConfig, out: Path, seeds: list[int], report_only: bool = False,
              world_size: int = DEFAULT_WORLD_SIZE, variants: list[str] | None = None,
              compute_dtype: str = "fp32") -> dict:
    """Train every missing run (none with ``report_only``), then write the table and plot
    over the finished ones."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {}
    for name, seed, zero in _runs(seeds, base, variants, compute_dtype):
        finished = (out / f"{_run_name(name, seed)}.summary.json").exists()
        if finished or not report_only:
            results.setdefault(name, {})[seed] = _run_once(base, out, name, seed, zero, world_size)
    if BASELINE not in results:
        raise ValueError(f"no finished {BASELINE} run in {out}: nothing to compare against")
    report = _table(results) | {"provenance": _study_provenance(results)}
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "table.md").write_text(_markdown(report) + "\n")
    curves = {}
    for name, runs in results.items():
        for seed in runs:
            steps, losses = _curves(out / f"{_run_name(name, seed)}.jsonl")
            curves[_run_name(name, seed)] = {"steps": steps, "validation_loss": losses}
    (out / "curves.json").write_text(json.dumps(curves) + "\n")  # the plot's data, small enough to keep
    _plot(results, out)
    logger.info(_markdown(report))
    return report


def _study_provenance(results: dict[str, dict[int, dict]]) -> dict:
    """This report's provenance, citable only when every run was trained at its commit on a
    clean tree (runs reused from an earlier study may come from other commits)."""
    source = provenance()
    commits = sorted({str(run.get("provenance", {}).get("git_commit")) for runs in results.values()
                      for run in runs.values()})
    source["run_commits"] = commits
    source["clean_tree"] = source["clean_tree"] and commits == [source["git_commit"]]
    return source


def _table(results: dict[str, dict[int, dict]]) -> dict:
    """Per variant: final validation loss per seed and the paired gap to ZeRO-3 in percent."""
    baseline = {seed: run["validation_loss"] for seed, run in results[BASELINE].items()}
    rows = {}
    for name, runs in results.items():
        gaps = {seed: (run["validation_loss"] - baseline[seed]) / baseline[seed] * 100 for seed, run in runs.items()}
        rows[name] = {
            "final_validation_loss": {seed: run["validation_loss"] for seed, run in runs.items()},
            "gap_percent": gaps,
            "mean_gap_percent": statistics.mean(gaps.values()),
            # Of the mean gap, over seeds: how far the mean could move with other seeds.
            "gap_standard_error": statistics.stdev(gaps.values()) / len(gaps) ** 0.5 if len(gaps) > 1 else None,
            "node_link_bytes_per_step": _node_link_bytes(*_config_and_world(next(iter(runs.values())))),
            # Measured at the end of a run; runs from before it was recorded have none.
            "resting_bytes_per_rank": next(
                (run["resting_bytes_per_rank"] for run in runs.values() if "resting_bytes_per_rank" in run), None),
        }
    losses = list(baseline.values())
    noise = (max(losses) - min(losses)) / statistics.mean(losses) * 100 if len(losses) > 1 else None
    return {"seeds": sorted(baseline), "noise_band_percent": noise, "runs": rows, "versus_zero_pp": _versus(rows)}


def _versus(rows: dict) -> dict:
    """Per main variant: its gap minus ZeRO++'s at each shared seed, the mean and its
    standard error (the question the study asks: closer to ZeRO-3 than ZeRO++?)."""
    if ZERO_PP_NAME not in rows:
        return {}
    reference = rows[ZERO_PP_NAME]["gap_percent"]
    result = {}
    for name, row in rows.items():
        shared = sorted(set(row["gap_percent"]) & set(reference))
        if name in (BASELINE, ZERO_PP_NAME) or len(shared) < 2:
            continue
        differences = [row["gap_percent"][seed] - reference[seed] for seed in shared]
        result[name] = {"seeds": shared, "difference_points": differences, "mean": statistics.mean(differences),
                        "standard_error": statistics.stdev(differences) / len(differences) ** 0.5}
    return result


def _node_link_bytes(config: dict, world_size: int = DEFAULT_WORLD_SIZE) -> int:
    """Most bytes of any training step into one node over its link, from the accounting (which the
    tests hold equal to the bytes each rank's collectives received, and the emulated
    cluster's interface counters to within 1%)."""
    zero = ZeroConfig(**{RENAMED_FIELDS.get(name, name): value for name, value in config["zero"].items()})
    work = gpt_work(config["model_size"], config["batch_per_rank"] * config["seq_len"], flops_per_s=1.0)
    per_node = config["ranks_per_node"]
    cluster = ClusterModel(num_nodes=world_size // per_node, ranks_per_node=per_node, inter_node_bytes_per_s=1.0)
    # The most of any step: before and after a change of bits.
    phases = (zero.at_step(0), zero.at_step(config["steps"]))
    return max(predict(work, cluster, phase)["inter_node_bytes_per_step"] for phase in phases)


def _config_and_world(run: dict) -> tuple[dict, int]:
    return run["config"], run.get("world_size", DEFAULT_WORLD_SIZE)


def markdown(report: dict) -> str:
    """The study's table as :func:`run_study` wrote it, from a ``summary.json`` read back
    (JSON keeps the seeds of each row as strings)."""
    runs = {name: {**row, **{key: {int(seed): value for seed, value in row[key].items()}
                             for key in ("final_validation_loss", "gap_percent")}}
            for name, row in report["runs"].items()}
    return _markdown({**report, "runs": runs})


def _markdown(report: dict) -> str:
    seeds = report["seeds"]
    header = ("| run | " + " | ".join(f"loss, seed {s}" for s in seeds)
              + " | paired gap per seed | mean gap ± standard error | MB/step over a node's link | MB at rest per rank |")
    lines = [header, "|---" * (len(seeds) + 5) + "|"]
    for name, row in report["runs"].items():
        final = row["final_validation_loss"]
        losses = " | ".join(f"{final[s]:.4f}" if s in final else "-" for s in seeds)
        gaps = ", ".join(f"{gap:+.2f}%" for gap in row["gap_percent"].values())
        error = row["gap_standard_error"]
        mean = f"{row['mean_gap_percent']:+.2f}%" + (f" ± {error:.2f}" if error else "")
        resting = row.get("resting_bytes_per_rank")
        resting_text = f"{resting / 1e6:.2f}" if resting else "-"
        lines.append(f"| {name} | {losses} | {gaps} | {mean} | "
                     f"{row['node_link_bytes_per_step'] / 1e6:.3f} | {resting_text} |")
    if report["noise_band_percent"] is not None:
        lines.append("\nZeRO-3 final validation loss across seeds (max - min over mean): "
                     f"{report['noise_band_percent']:.2f}%")
    for name, versus in report["versus_zero_pp"].items():
        per_seed = ", ".join(f"{value:+.2f}" for value in versus["difference_points"])
        lines.append(f"\n{name} minus ZeRO++, paired gap difference in points per seed: {per_seed}; "
                     f"mean {versus['mean']:+.2f} ± {versus['standard_error']:.2f} (standard error)")
    return "\n".join(lines)


def _curves(path: Path) -> tuple[list[int], list[float]]:
    """(steps, validation losses) of one run: from its metrics, or, for a run whose metrics
    were not kept, from the ``curves.json`` an earlier report left beside it."""
    if not path.exists():
        stored = json.loads((path.parent / "curves.json").read_text()).get(path.name.removesuffix(".jsonl"))
        if stored is None:
            raise ValueError(f"{path} is missing and {path.parent / 'curves.json'} has no curve for it")
        return stored["steps"], stored["validation_loss"]
    steps, losses = [], []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "validation_loss" in record:
            steps.append(record["step"] + 1)
            losses.append(record["validation_loss"])
    return steps, losses


def _plot(results: dict[str, dict[int, dict]], out: Path) -> None:
    """Top: validation loss per variant (mean over its seeds). Bottom: paired gap to ZeRO-3, mean and range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9), sharex=True)
    colors = plt.get_cmap("tab10").colors
    baseline = {seed: _curves(out / f"{_run_name(BASELINE, seed)}.jsonl")[1] for seed in results[BASELINE]}
    for index, (name, runs) in enumerate(results.items()):
        curves = {seed: _curves(out / f"{_run_name(name, seed)}.jsonl") for seed in runs}
        steps = next(iter(curves.values()))[0]
        several = len(runs) > 1  # main variants: solid; one-seed extras: thin and dashed
        style = dict(color=colors[index % len(colors)], linewidth=1.8 if several else 0.8, linestyle="-" if several else "--")
        top.plot(steps, [statistics.mean(values) for values in zip(*(c[1] for c in curves.values()))],
                 label=f"{name} ({len(runs)} seed{'s' if several else ''})", **style)
        if not several or name == BASELINE:
            continue  # one seed's gap is mostly noise; the table lists them
        per_seed = [[(a - b) / b * 100 for a, b in zip(curves[seed][1], baseline[seed])] for seed in runs]
        bottom.plot(steps, [statistics.mean(values) for values in zip(*per_seed)], label=name, **style)
        bottom.fill_between(steps, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)],
                            color=style["color"], alpha=0.12)
    top.set_ylabel("validation loss (mean over seeds)")
    top.legend(fontsize=7)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.legend(fontsize=7)
    bottom.set_ylabel("paired gap to ZeRO-3 (%), mean and range over seeds")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(out / "convergence.png", dpi=110)


def main(args) -> int:
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    num_nodes, ranks_per_node = parse_layout(args.layout)
    variants = None
    if args.variants != "all":
        variants = [key.strip() for key in args.variants.split(",")]
        unknown = [key for key in variants if key not in VARIANT_KEYS]
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; allowed values: 'all' or a comma-separated list of "
                             f"{list(VARIANT_KEYS)}")
        if "zero3" not in variants:
            raise ValueError("--variants must include zero3: every gap is paired with it")
    base = TrainConfig(
        model_size=args.model, steps=args.steps, batch_per_rank=args.batch_per_rank, seq_len=args.seq_len,
        learning_rate=args.lr, eval_every=args.eval_every, eval_batches=args.eval_batches,
        ranks_per_node=ranks_per_node,
    )
    compute_dtype, why = chosen_precision(args.precision)
    logger.info(f"computing in {compute_dtype} ({why})")
    run_study(base, Path(args.out), seeds, report_only=args.report_only, world_size=num_nodes * ranks_per_node,
              variants=variants, compute_dtype=compute_dtype)
    return 0
