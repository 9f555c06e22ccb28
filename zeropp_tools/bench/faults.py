"""``zeropp bench faults``: faults injected into real runs, what happened, and what was lost.

    zeropp bench faults --out benchmarks/results/faults           # all scenarios (root; ~20 min on 2 cores)
    zeropp bench faults --scenarios disk_full,soak

Scenarios (2 nodes x 2 ranks, GPT tiny; the cluster ones run torchrun in network
namespaces, see ``zeropp_tools.cluster``):

- ``link_flap``: node 1's link is pulled for 5 s mid-run, then plugged back. Promised: no
  error, every loss identical to an undisturbed run.
- ``link_down``: the link is pulled for good with a 10 s collective timeout. Promised:
  every rank ends with a collective error, each node within the timeout plus 10 s.
- ``node_killed``: node 1's training processes are killed mid-step under torchrun with
  ``--max-restarts 1``. Promised: the job restarts by itself, ``--resume`` finds the latest
  checkpoint, the losses after it equal an undisturbed run's, at most a checkpoint
  interval of steps is recomputed.
- ``disk_full``: checkpoints go to a small tmpfs that holds one. Promised: an error naming
  the path and the bytes needed; the previous checkpoint loads and verifies; the run stops
  (``on_save_error="stop"``) or trains on (``"continue"``).
- ``soak``: 3,000 steps with a checkpoint every 100. Promised: resident memory per rank
  flat (max/min over the second half <= 1.05), open files and threads constant.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from zeropp.checkpoint import CheckpointError, resolve_checkpoint
from zeropp.checkpoint.format import read_metadata, verify_file
from zeropp.launch import spawn_ranks
from zeropp.train import TrainConfig, train
from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.runner import run_on_cluster

logger = logging.getLogger(__name__)

SPEC = ClusterSpec(2, 2)
STEPS = 60
FAULT_AT_STEP = 20
CHECKPOINT_EVERY = 10
TIMEOUT_S = 10
TRAIN = ["train", "--model", "tiny", "--batch-per-rank", "2", "--seq-len", "32", "--steps", str(STEPS)]
SCENARIOS = ("link_flap", "link_down", "node_killed", "disk_full", "soak")


def read_losses(metrics: Path) -> dict[int, float]:
    """{step: loss} from a metrics file; a step run twice (after a restart) keeps its last loss."""
    losses = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return losses


def _records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def wait_for_step(metrics: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(record["step"] >= step for record in _records(metrics)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{metrics} did not reach step {step} within {timeout_s:.0f}s")


def _cluster_run(folder: Path, extra: list[str], **options) -> tuple[dict, Path]:
    out = folder / "run"
    result = run_on_cluster(SPEC, TRAIN + ["--out", str(out)] + extra, timeout_s=600, logs=folder / "logs", **options)
    return result, out / "metrics.jsonl"


def link_flap(folder: Path, reference: dict[int, float]) -> dict:
    metrics = folder / "run" / "metrics.jsonl"

    def pull_for_five_seconds(cluster):
        wait_for_step(metrics, FAULT_AT_STEP)
        cluster.set_link(1, up=False)
        time.sleep(5)
        cluster.set_link(1, up=True)
        return {"down_at_step": max(read_losses(metrics))}

    result, metrics = _cluster_run(folder, [], during=pull_for_five_seconds)
    losses = read_losses(metrics)
    identical = losses == reference
    stall = max(record["step_s"] for record in _records(metrics))
    return {
        "fault": "link_flap", "injected": f"node 1's link down for 5 s at step {result['during']['down_at_step']}, then up",
        "outcome": f"exit codes {result['exit_codes']}; losses identical to the undisturbed run: {identical}; "
                   f"longest step {stall:.1f} s",
        "steps_lost": 0 if identical else None, "detect_s": None,
        "ok": result["exit_codes"] == [0, 0] and identical,
    }


def link_down(folder: Path) -> dict:
    metrics = folder / "run" / "metrics.jsonl"

    def pull_for_good(cluster):
        wait_for_step(metrics, FAULT_AT_STEP)
        cluster.set_link(1, up=False)
        return {"at": time.monotonic(), "step": max(read_losses(metrics))}

    result, _ = _cluster_run(folder, ["--timeout", str(TIMEOUT_S)], during=pull_for_good)
    pulled = result["during"]["at"]
    ended = [None if t is None else t - pulled for t in result["exit_times"]]
    logs = [(folder / "logs" / f"node{node}.log").read_text() for node in range(SPEC.num_nodes)]
    reports = [log.count("CollectiveError: rank") for log in logs]
    within = all(t is not None and t <= TIMEOUT_S + 10 for t in ended)
    return {
        "fault": "link_down", "injected": f"node 1's link down for good at step {result['during']['step']} "
                                          f"(collective timeout {TIMEOUT_S} s)",
        "outcome": f"exit codes {result['exit_codes']}; collective errors reported per node {reports}; "
                   f"nodes ended {', '.join('never' if t is None else f'{t:.1f} s' for t in ended)} after the fault",
        "steps_lost": None, "detect_s": max((t for t in ended if t is not None), default=None),
        "ok": within and all(code not in (0, None) for code in result["exit_codes"])
              and reports == [SPEC.ranks_per_node] * SPEC.num_nodes,
    }


def node_killed(folder: Path, reference: dict[int, float]) -> dict:
    """Kill node 1's training processes mid-run under ``torchrun --max-restarts 1``: both
    agents start new workers in a new rendezvous round, which resume by themselves.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default torchrun (2.13) keeps one store
    for all rounds, so the restarted workers read the previous round's gloo addresses and
    fail to connect ("Connection refused") in round after round."""
    metrics = folder / "run" / "metrics.jsonl"

    def kill_node_one(cluster):
        wait_for_step(metrics, FAULT_AT_STEP + CHECKPOINT_EVERY // 2)
        workers = {pid: line for pid, line in cluster.processes(1).items()
                   if "zeropp_tools.cli.main" in line and "torch.distributed.run" not in line}
        seen = len(_records(metrics))
        killed_at, step = time.monotonic(), max(read_losses(metrics))
        for pid in workers:
            os.kill(pid, 9)
        back_s = None  # until the restarted job logs its first step again
        while back_s is None and time.monotonic() - killed_at < 300:
            if any(record["step"] <= step for record in _records(metrics)[seen:]):
                back_s = time.monotonic() - killed_at
            time.sleep(0.05)
        return {"step": step, "killed": len(workers), "back_s": back_s}

    extra = ["--checkpoint-dir", str(folder / "checkpoints"), "--checkpoint-every", str(CHECKPOINT_EVERY), "--resume"]
    result, metrics = _cluster_run(folder, extra, max_restarts=1, during=kill_node_one,
                                   environment={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    records = _records(metrics)
    steps = [record["step"] for record in records]
    recomputed = len(steps) - len(set(steps))
    identical = read_losses(metrics) == reference
    resumed = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    resumed_at = None if resumed is None else steps[resumed]
    back_s = result["during"]["back_s"]
    return {
        "fault": "node_killed",
        "injected": f"{result['during']['killed']} training processes of node 1 killed (SIGKILL) at step "
                    f"{result['during']['step']}, under torchrun --max-restarts 1",
        "outcome": f"exit codes {result['exit_codes']}; torchrun restarted both nodes' workers, which resumed at "
                   f"step {resumed_at} from the latest checkpoint, training again {back_s:.1f} s after the kill; "
                   f"losses identical to the undisturbed run: {identical}" if back_s is not None else
                   f"exit codes {result['exit_codes']}; the job did not train again within 300 s",
        "steps_lost": recomputed, "detect_s": back_s,
        "ok": result["exit_codes"] == [0, 0] and identical and resumed_at is not None and recomputed <= CHECKPOINT_EVERY,
    }


def _tiny_config(**overrides) -> TrainConfig:
    base = TrainConfig(model_size="tiny", steps=30, batch_per_rank=2, seq_len=32, eval_every=1000, ranks_per_node=2,
                       checkpoint_every=CHECKPOINT_EVERY)
    return replace(base, **overrides)


def mount_small_tmpfs(folder: Path, size_bytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], check=True,
                   capture_output=True)


def verify_checkpoint(root: Path) -> int:
    """Verify every file of the latest checkpoint under ``root``; return its step."""
    folder = resolve_checkpoint(root)
    metadata = read_metadata(folder)
    for name in metadata["files"]:
        verify_file(folder, name, metadata)
    return metadata["step"]


def disk_full(folder: Path, size_bytes: int = 2_500_000) -> dict:
    """One checkpoint of GPT tiny on 4 ranks is about 1.5 MB: the tmpfs holds one."""
    rows = {}
    for policy in ("stop", "continue"):
        disk = folder / f"disk_{policy}"
        mount_small_tmpfs(disk, size_bytes)
        try:
            config = _tiny_config(checkpoint_dir=str(disk), on_save_error=policy)
            try:
                summary = spawn_ranks(train, 4, (config,))[0]
                outcome = f"trained to step {len(summary['losses'])}"
            except CheckpointError as error:
                outcome = f"stopped: {str(error).splitlines()[0]}"
            rows[policy] = {"outcome": outcome, "latest_verified_step": verify_checkpoint(disk)}
        finally:
            subprocess.run(["umount", str(disk)], capture_output=True)
    stopped, continued = rows["stop"], rows["continue"]
    return {
        "fault": "disk_full", "injected": f"checkpoints every {CHECKPOINT_EVERY} steps to a {size_bytes / 1e6:.1f} MB "
                                          "tmpfs (room for one)",
        "outcome": f"on_save_error='stop': {stopped['outcome']}; 'continue': {continued['outcome']}; the previous "
                   f"checkpoint (step {stopped['latest_verified_step']}) loads and verifies",
        "steps_lost": 0, "detect_s": None,
        "ok": (stopped["outcome"].startswith("stopped") and "needs" in stopped["outcome"]
               and continued["outcome"] == "trained to step 30"
               and stopped["latest_verified_step"] == continued["latest_verified_step"] == CHECKPOINT_EVERY),
        "policies": rows,
    }


def soak(folder: Path, steps: int = 3000) -> dict:
    config = _tiny_config(steps=steps, checkpoint_every=100, checkpoint_dir=str(folder / "checkpoints"),
                          metrics_path=str(folder / "soak_metrics.jsonl"), record_resources=True)
    spawn_ranks(train, 4, (config,), timeout_s=3 * 3600)
    records = _records(folder / "soak_metrics.jsonl")
    second_half = records[len(records) // 2:]
    ratios, constant = [], True
    for rank in range(4):
        rss = [record["resources"][rank]["rss_bytes"] for record in second_half]
        ratios.append(max(rss) / min(rss))
        for key in ("open_files", "threads"):
            values = {record["resources"][rank][key] for record in second_half}
            constant = constant and len(values) == 1
    _plot_soak(records, folder / "soak.png")
    return {
        "fault": "soak", "injected": f"{steps} steps, a checkpoint every 100",
        "outcome": f"resident memory max/min over the second half per rank {', '.join(f'{r:.3f}' for r in ratios)}; "
                   f"open files and threads constant: {constant}",
        "steps_lost": 0, "detect_s": None, "ok": max(ratios) <= 1.05 and constant,
        "rss_ratio_by_rank": ratios,
    }


def _plot_soak(records: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.5))
    axes = figure.add_subplot()
    steps = [record["step"] for record in records]
    for rank in range(len(records[0]["resources"])):
        axes.plot(steps, [record["resources"][rank]["rss_bytes"] / 2**20 for record in records], label=f"rank {rank}")
    second_half = records[len(records) // 2:]
    lowest = min(record["resources"][rank]["rss_bytes"] for record in second_half
                 for rank in range(len(record["resources"]))) / 2**20
    axes.axhline(lowest * 1.05, color="gray", linestyle="--", linewidth=1, label="1.05x the lowest (second half)")
    axes.set_ylim(0, lowest * 1.15)  # from zero: a flat line should look flat
    axes.set_xlabel("step")
    axes.set_ylabel("resident memory (MiB)")
    axes.set_title("soak: GPT tiny, 4 ranks, a checkpoint every 100 steps")
    axes.legend(loc="lower right")
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(path))


def run(folder: Path, scenarios: tuple[str, ...] = SCENARIOS) -> list[dict]:
    """Every scenario asked for, each in its own folder; the cluster ones share one
    undisturbed reference run."""
    rows, reference = [], None
    for name in scenarios:
        logger.info("fault scenario %s ...", name)
        where = folder / name
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        if name in ("link_flap", "node_killed") and reference is None:
            result, metrics = _cluster_run(folder / "undisturbed", [])
            if result["exit_codes"] != [0, 0]:
                raise RuntimeError(f"the undisturbed run failed: {result['output'][-2000:]}")
            reference = read_losses(metrics)
        if name == "link_flap":
            rows.append(link_flap(where, reference))
        elif name == "link_down":
            rows.append(link_down(where))
        elif name == "node_killed":
            rows.append(node_killed(where, reference))
        elif name == "disk_full":
            rows.append(disk_full(where))
        else:
            rows.append(soak(where))
        logger.info("  %s: %s", "ok" if rows[-1]["ok"] else "NOT AS PROMISED", rows[-1]["outcome"])
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| fault | injected | outcome | steps lost | time to detect | as promised |", "|---|---|---|---|---|---|"]
    for row in rows:
        lost = "-" if row["steps_lost"] is None else str(row["steps_lost"])
        detect = "-" if row["detect_s"] is None else f"{row['detect_s']:.1f} s"
        lines.append(f"| {row['fault']} | {row['injected']} | {row['outcome']} | {lost} | {detect} | "
                     f"{'yes' if row['ok'] else 'NO'} |")
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args) -> int:
    from zeropp_tools.bench.provenance import provenance

    # A killed benchmark still tears its namespaces down (the cluster's context manager).
    signal.signal(signal.SIGTERM, _interrupt)
    folder = Path(tempfile.mkdtemp(prefix="zeropp-faults-"))
    scenarios = tuple(args.scenarios.split(","))
    unknown = [name for name in scenarios if name not in SCENARIOS]
    if unknown:
        raise ValueError(f"--scenarios: unknown {unknown}; allowed values: {list(SCENARIOS)}")
    rows = run(folder, scenarios)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"rows": rows, **provenance()}, indent=2) + "\n")
    (out / "faults.md").write_text(markdown(rows) + "\n")
    if (folder / "soak" / "soak.png").exists():
        shutil.copy(folder / "soak" / "soak.png", out / "soak.png")
    logger.info("%s\nwrote %s (runs kept in %s)", markdown(rows), out, folder)
    return 0 if all(row["ok"] for row in rows) else 1
