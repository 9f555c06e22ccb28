"""The ZeRO++ paper's cluster, simulated: ``zeropp plan --paper``.

384 V100s as 24 DGX-2 nodes of 16, with 4 or 1 InfiniBand adapters of 100 Gbit/s per node
(the paper's "4 IB" and "1 IB"), fp16, activation checkpointing. Each scheme's schedule is
recorded from the engine by a dry run (rank 0 of 384, fake process group, meta device) and
replayed on the V100 description (``zeropp/simulate/hardware/v100-dgx2.json``, written
before the comparison and not fitted to it).

TFLOP/s per GPU are counted as the paper counts them (DeepSpeed's Megatron formula with
recomputation): 2 (forward) + 2 (recomputed forward) + 4 (backward) FLOPs per parameter and
token, over the simulated step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import torch.distributed as dist

from zeropp.simulate.hardware import Hardware
from zeropp.simulate.schedule import Schedule
from zeropp.simulate.simulator import simulate
from zeropp_tools.dryrun import DryRun, config_for, dry_run_schedule, join_fake_world

logger = logging.getLogger(__name__)

MODELS = {"18B": (40, 6144), "49B": (40, 10240), "138B": (100, 10752)}
VOCABULARY = 50_000


@dataclass(frozen=True)
class Row:
    model: str
    adapters: int  # 100 Gbit/s InfiniBand adapters per node
    tokens_per_gpu: int
    published: tuple[float, float]  # (ZeRO-3, ZeRO++) TFLOP/s per GPU


# TFLOP/s per GPU, ZeRO-3 -> ZeRO++, from the DeepSpeed ZeRO++ blog's throughput figures
# (github.com/microsoft/DeepSpeed, blogs/zeropp/assets/images/eval1.png, eval2.png,
# eval3.png). The 18B rows with 4 and 1 adapters are the ones the simulator is held to.
PUBLISHED = (
    Row("18B", 4, 1024, (25, 35)),
    Row("18B", 4, 2048, (40, 53)),
    Row("18B", 1, 1024, (14, 31)),
    Row("18B", 1, 2048, (26, 46)),
)
# The blog's other configurations: larger models (its 91B is left out: its shape is not
# stated), and 2 and 8 adapters (200 and 800 Gbit/s per node) with 2K tokens.
OTHER_PUBLISHED = (
    Row("49B", 4, 1024, (23, 36)), Row("49B", 4, 2048, (36, 51)),
    Row("49B", 1, 1024, (11, 22)), Row("49B", 1, 2048, (20, 38)),
    Row("138B", 4, 1024, (23, 36)), Row("138B", 4, 2048, (36, 50)),
    Row("138B", 1, 1024, (11, 22)), Row("138B", 1, 2048, (20, 38)),
    Row("18B", 2, 2048, (37, 50)), Row("18B", 8, 2048, (47, 54)),
    Row("138B", 2, 2048, (32, 48)), Row("138B", 8, 2048, (48, 55)),
)


# V100 SXM datasheet: 125 TFLOP/s in fp16 on the tensor cores.
V100_PEAK_FLOPS = 125e12


def implied_by_published(rows: tuple[Row, ...] = (*PUBLISHED, *OTHER_PUBLISHED)) -> list[dict]:
    """What the published figures say by themselves, with no hardware model: for each model
    and adapter count published at both 1K and 2K tokens per GPU, per scheme, the step each
    figure means (8 FLOPs per parameter and token, parameters 12 L h^2 + V h), the marginal
    rate (the 2K step's extra FLOPs over its extra time) and, with compute at that rate, the
    time of the 1K step that is not compute. A marginal rate near or above the peak says the
    extra compute hid under something else; a step of any one compute rate plus a fixed
    time cannot give both figures with a rate below it."""
    by_shape = {}
    for row in rows:
        by_shape.setdefault((row.model, row.adapters), {})[row.tokens_per_gpu] = row.published
    implied = []
    for (model, adapters), published in by_shape.items():
        if not {1024, 2048} <= published.keys():
            continue
        layers, hidden = MODELS[model]
        flops_per_token = 8 * (12 * layers * hidden * hidden + VOCABULARY * hidden)
        small, large = (flops_per_token * tokens for tokens in (1024, 2048))
        for index, scheme in enumerate(("zero3", "zero++")):
            step_small = small / (published[1024][index] * 1e12)
            step_large = large / (published[2048][index] * 1e12)
            marginal = (large - small) / (step_large - step_small)
            implied.append({"model": model, "adapters": adapters, "scheme": scheme, "step_1k_s": step_small,
                            "step_2k_s": step_large, "marginal_flops": marginal,
                            "not_compute_1k_s": step_small - small / marginal})
    return implied


def implied_markdown(implied: list[dict]) -> str:
    lines = ["| model | IB x 100 Gbit/s | scheme | step at 1K / 2K tokens (s) | marginal TFLOP/s | of the V100's peak "
             "| 1K step not compute at that rate (s) |", "|---|---|---|---|---|---|---|"]
    for entry in implied:
        lines.append(f"| {entry['model']} | {entry['adapters']} | {entry['scheme']} | {entry['step_1k_s']:.2f} / "
                     f"{entry['step_2k_s']:.2f} | {entry['marginal_flops'] / 1e12:.0f} | "
                     f"{entry['marginal_flops'] / V100_PEAK_FLOPS:.0%} | {entry['not_compute_1k_s']:.2f} |")
    return "\n".join(lines)


def schedules(model: str, prefetch: bool = True) -> dict[str, Schedule]:
    """ZeRO-3's and ZeRO++'s schedules for ``model`` on 24 x 16, recorded by dry runs. With
    ``prefetch`` False the engine gathers each unit only when it is needed, so no gather
    overlaps compute: the schedule of a ZeRO-3 that hides none of its communication."""
    layers, hidden = MODELS[model]
    recorded = {}
    for variant in ("zero3", "zero++"):
        run = DryRun(layers=layers, hidden=hidden, vocabulary=VOCABULARY, variant=variant)
        join_fake_world(run)
        try:
            recorded[variant] = dry_run_schedule(run, replace(config_for(run), prefetch=prefetch))
        finally:
            dist.destroy_process_group()
    return recorded


def simulate_row(row: Row, recorded: dict[str, Schedule], hardware: Hardware) -> dict:
    """Simulated TFLOP/s per GPU of both schemes in ``row``, and what bounds each."""
    cluster = hardware.with_adapters(row.adapters)
    result = {}
    for variant, schedule in recorded.items():
        # The collectives do not depend on the batch: only the compute between them does.
        step = simulate(replace(schedule, tokens_per_rank=row.tokens_per_gpu), cluster)
        result[variant] = {"tflops": step.flops / step.step_s / 1e12, "step_s": step.step_s,
                           "bottleneck": step.bottleneck, "stalled_s": step.stalled_s}
    return result


def paper_report(hardware_name: str = "v100-dgx2", prefetch: bool = True) -> dict:
    """Every row simulated, as JSON: the hardware description (with its sources) and, per
    row, both schemes' TFLOP/s, step and bound. ``prefetch``: as :func:`schedules`."""
    hardware = Hardware.load(hardware_name)
    recorded = {}
    rows = []
    for row in (*PUBLISHED, *OTHER_PUBLISHED):
        if row.model not in recorded:
            recorded[row.model] = schedules(row.model, prefetch)
        rows.append({"row": asdict(row), **simulate_row(row, recorded[row.model], hardware)})
    return {"hardware": asdict(hardware), "rows": rows}


def paper_markdown(report: dict, listed_only: bool = False) -> str:
    """The rows as a table; ``listed_only``: the 18B rows of :data:`PUBLISHED` alone."""
    lines = ["| model | IB x 100 Gbit/s | tokens/GPU | ZeRO-3 published | simulated | error | ZeRO++ published | "
             "simulated | error | speedup published | simulated | error | bounded by (ZeRO-3 / ZeRO++) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for entry in [entry for entry in report["rows"] if _listed(entry)] if listed_only else report["rows"]:
        row = entry["row"]
        zero3, zeropp = entry["zero3"]["tflops"], entry["zero++"]["tflops"]
        published3, published_pp = row["published"]
        cells = [f"{published3:.0f}", f"{zero3:.1f}", _error(zero3, published3), f"{published_pp:.0f}",
                 f"{zeropp:.1f}", _error(zeropp, published_pp), f"{published_pp / published3:.2f}x",
                 f"{zeropp / zero3:.2f}x", _error(zeropp / zero3, published_pp / published3)]
        bounds = f"{entry['zero3']['bottleneck']} / {entry['zero++']['bottleneck']}"
        lines.append(f"| {row['model']} | {row['adapters']} | {row['tokens_per_gpu']} | " + " | ".join(cells)
                     + f" | {bounds} |")
    return "\n".join(lines)


def paper_summary(report: dict) -> dict:
    """How many rows the simulation holds (both TFLOP/s within 15%, the speedup within 10%):
    the 18B rows it is held to, and the blog's other rows."""
    listed = [entry for entry in report["rows"] if _listed(entry)]
    others = [entry for entry in report["rows"] if not _listed(entry)]
    return {**_held(listed), **{f"other_{key}": value for key, value in _held(others).items()}}


def _listed(entry: dict) -> bool:
    """Whether a report row is one of the 18B rows of :data:`PUBLISHED`, told by its content
    (the JSON keeps the row's fields, and ``published`` comes back as a list)."""
    row = entry["row"]
    return Row(row["model"], row["adapters"], row["tokens_per_gpu"], tuple(row["published"])) in PUBLISHED


def _held(entries: list[dict]) -> dict:
    tflops = speedup = 0
    for entry in entries:
        zero3, zeropp = entry["row"]["published"]
        simulated3, simulated_pp = entry["zero3"]["tflops"], entry["zero++"]["tflops"]
        tflops += abs(simulated3 / zero3 - 1) <= 0.15 and abs(simulated_pp / zeropp - 1) <= 0.15
        speedup += abs((simulated_pp / simulated3) / (zeropp / zero3) - 1) <= 0.10
    return {"rows": len(entries), "tflops_within_15_percent": tflops, "speedup_within_10_percent": speedup}


def _error(simulated: float, published: float) -> str:
    return f"{(simulated - published) / published * 100:+.0f}%"
