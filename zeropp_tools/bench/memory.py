"""``zeropp bench memory``: peak memory per rank of zeropp ZeRO-3, zeropp ZeRO++, FSDP2 and
DDP on 4 CPU ranks (2 nodes x 2) of this machine, side by side in one run, and the largest
Llama-style model each trains.

    zeropp bench memory                                     # fixed model, then the search
    zeropp bench memory --engines zeropp-zero3,fsdp2 --no-search

Part 1, one fixed model (default hidden 1024, 24 layers: 374M parameters): every engine
trains it three steps and reports each rank's peak resident set above its baseline and its
peak of live tensor bytes (see :mod:`zeropp_tools.bench.memory_engines`).

Part 2, the search: the largest model (hidden fixed, layers varied) whose three training
steps keep the four ranks' peak resident sets within ``--ram-fraction`` of the machine's
RAM. Peak memory is affine in the parameter count at a fixed batch, so each engine is
measured at two sizes, the line through them proposes the largest layer count, that size
is run, and the line through the two largest runs refines the proposal (one layer up
after a fit, down after a run over the budget). The result is the largest size measured
within the budget, with the next size measured over it or predicted over it. An engine whose run is predicted over the budget is not
started (the machine has no swap: it would be killed, or take the others with it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from zeropp.launch import spawn_ranks
from zeropp_tools.bench.memory_engines import ENGINES, LlamaShape, MemoryRun, run_rank
from zeropp_tools.bench.provenance import provenance

logger = logging.getLogger(__name__)

WORLD_SIZE = 4
RANKS_PER_NODE = 2
SMALL_LAYERS = 2  # the search's first size
MAX_TRIES = 4  # runs per engine while narrowing down the largest size


def total_ram_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemTotal is not in /proc/meminfo")


def measure(engine: str, shape: LlamaShape) -> dict:
    """Train ``shape`` three steps with ``engine`` on 4 new ranks; peaks per rank."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed blocks return to the system: RSS tracks live memory
    started = time.monotonic()
    try:
        ranks = spawn_ranks(run_rank, WORLD_SIZE, (MemoryRun(engine, shape, RANKS_PER_NODE),), timeout_s=3600)
    except (RuntimeError, MemoryError) as error:  # a rank killed for memory counts as over the budget
        logger.info(f"{engine:<14} {shape.parameters / 1e6:>7.0f}M  FAILED: {error}")
        return {"engine": engine, "hidden": shape.hidden, "layers": shape.layers, "parameters": shape.parameters,
                "failed": str(error), "baseline_rss_bytes": [0] * WORLD_SIZE,
                "peak_rss_bytes": [total_ram_bytes()] * WORLD_SIZE, "peak_live_bytes": [0] * WORLD_SIZE}
    result = {
        "engine": engine, "hidden": shape.hidden, "layers": shape.layers, "parameters": shape.parameters,
        "baseline_rss_bytes": [rank["baseline_rss_bytes"] for rank in ranks],
        "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in ranks],
        "peak_live_bytes": [rank["peak_live_bytes"] for rank in ranks],
        "phase_peak_live_bytes": ranks[0]["phase_peak_live_bytes"],
        "losses": ranks[0]["losses"], "seconds": round(time.monotonic() - started, 1),
    }
    logger.info(f"{engine:<14} {shape.parameters / 1e6:>7.0f}M  peak RSS per rank (max) "
                f"{max(result['peak_rss_bytes']) / 1e9:6.3f} GB, live tensors {max(result['peak_live_bytes']) / 1e9:6.3f} GB "
                f"({result['seconds']:.0f} s)")
    return result


def _total(result: dict) -> int:
    """What the four processes hold together at their peaks, baselines included (they share
    this machine's RAM)."""
    return sum(result["peak_rss_bytes"]) + sum(result["baseline_rss_bytes"])


def _predicted_total(first: dict, second: dict, layers: int) -> float:
    slope = (_total(second) - _total(first)) / (second["layers"] - first["layers"])
    return _total(first) + slope * (layers - first["layers"])


def _largest_layers(first: dict, second: dict, budget: int) -> int:
    slope = (_total(second) - _total(first)) / (second["layers"] - first["layers"])
    return first["layers"] + int((budget - _total(first)) / slope)


def search(engine: str, hidden: int, budget: int, known: list[dict]) -> dict:
    """The largest layer count of width ``hidden`` that ``engine`` trains within ``budget``:
    a line through two measured sizes proposes one, and each run refines it (see
    :func:`_next_size`) until a fitting size has its next size over the budget, measured
    or predicted (a size predicted over is not started: no swap here)."""
    runs = [run for run in known if run["engine"] == engine and run["hidden"] == hidden]
    if not any(run["layers"] == SMALL_LAYERS for run in runs):
        runs.append(measure(engine, LlamaShape(hidden, SMALL_LAYERS)))
    if len({run["layers"] for run in runs}) < 2:
        runs.append(measure(engine, LlamaShape(hidden, 2 * SMALL_LAYERS)))
    for _ in range(MAX_TRIES):
        candidate = _next_size(runs, budget)
        if candidate is None:
            break
        runs.append(measure(engine, LlamaShape(hidden, candidate)))
    within = [run for run in runs if _total(run) <= budget]
    best_run = max(within, key=lambda run: run["layers"]) if within else None
    ordered = sorted(runs, key=lambda run: run["layers"])
    first, second = ordered[-2], ordered[-1]
    return {"engine": engine, "largest": best_run, "runs": runs,
            "next_size_measured": best_run is not None and any(run["layers"] == best_run["layers"] + 1 for run in runs),
            "next_size_predicted_total_bytes": None if best_run is None else _predicted_total(first, second, best_run["layers"] + 1)}


def _next_size(runs: list[dict], budget: int) -> int | None:
    """The next layer count to measure, or None once the boundary is known: the largest
    fitting size ``low`` with ``low + 1`` measured over the budget, or predicted over it by
    the line through the two largest sizes measured."""
    measured = {run["layers"]: run for run in runs}
    fitting = [layers for layers in measured if _total(measured[layers]) <= budget]
    over = [layers for layers in measured if _total(measured[layers]) > budget]
    if not fitting:
        return min(measured) - 1 if min(measured) > 1 else None
    low = max(fitting)
    high = min((layers for layers in over if layers > low), default=None)
    if high is not None:
        if high == low + 1:
            return None
        # Interpolate between the fitting and the failing size.
        return min(high - 1, max(low + 1, _largest_layers(measured[low], measured[high], budget)))
    below = max(layers for layers in measured if layers < low) if len(measured) > 1 else None
    if below is None:
        return None
    if _predicted_total(measured[below], measured[low], low + 1) > budget:
        return None
    return max(low + 1, _largest_layers(measured[below], measured[low], budget))


def _fits(engine: str, shape: LlamaShape, budget: int) -> bool:
    """A conservative guess before starting a run: DDP holds about 20 bytes per parameter
    per rank (weights, gradients, two Adam moments, buckets)."""
    if engine != "ddp":
        return True
    return WORLD_SIZE * 20 * shape.parameters < budget


def main(args) -> int:
    engines = args.engines.split(",")
    unknown = [engine for engine in engines if engine not in ENGINES]
    if unknown:
        raise ValueError(f"--engines: unknown {unknown}; allowed values: {list(ENGINES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = int(args.ram_fraction * total_ram_bytes())
    fixed_shape = LlamaShape(args.hidden, args.layers)
    report = {"command": "zeropp bench memory", "arguments": vars(args) | {"func": None}, "provenance": provenance(),
              "world_size": WORLD_SIZE, "ranks_per_node": RANKS_PER_NODE, "budget_bytes": budget,
              "total_ram_bytes": total_ram_bytes(), "fixed": {}, "search": {}}
    report["arguments"].pop("func")
    logger.info(f"fixed model: hidden {args.hidden}, {args.layers} layers, {fixed_shape.parameters / 1e6:.0f}M parameters; "
                f"budget {budget / 1e9:.1f} GB ({args.ram_fraction:.0%} of RAM) for the search")

    def save() -> None:
        (out / "memory.json").write_text(json.dumps(report, indent=2) + "\n")

    for engine in engines:
        if _fits(engine, fixed_shape, budget):
            report["fixed"][engine] = measure(engine, fixed_shape)
        else:
            report["fixed"][engine] = {"engine": engine, "skipped": "predicted over the RAM budget"}
        save()
    if not args.no_search:
        known = [run for run in report["fixed"].values() if "peak_rss_bytes" in run]
        for engine in engines:
            report["search"][engine] = search(engine, args.hidden, budget, known)
            save()
    from zeropp_tools.bench.memory_report import write_report

    write_report(report, out)
    return 0
