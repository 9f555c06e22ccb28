"""One benchmark cell: a zeropp variant or a peer trained on the emulated cluster, with its
tokens/s, exposed communication, and the bytes the accounting and the link counters saw."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from zeropp_tools.cli.train_flags import scheme_flags
from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.emulated import payload_bytes
from zeropp_tools.cluster.runner import run_on_cluster
from zeropp_tools.schemes import QUALITY_SETTINGS, named_schemes

VARIANTS = tuple(named_schemes(ranks_per_node=2))
"""zeropp's variants, by their names in :mod:`zeropp_tools.schemes`; the names up to auto
are auto mode's candidates'. Any of them may carry suffixes from ``SUFFIXES``, e.g.
``log-grid+prefetch2``."""
SUFFIXES = {
    "+compiled": ["--compile-quantization"],  # quantization kernels through torch.compile
    "+prefetch2": ["--prefetch-units", "2"],  # two units' gathers in flight
    "-every-micro-step": ["--reduce-every-micro-step"],  # accumulation reducing across nodes in each micro-step
}


def _split_suffixes(name: str) -> tuple[str, list[str]]:
    """``name`` -> (base variant, the flags of its suffixes)."""
    flags: list[str] = []
    stripped = True
    while stripped:
        stripped = False
        for suffix, suffix_flags in SUFFIXES.items():
            if name.endswith(suffix):
                name, flags, stripped = name.removesuffix(suffix), suffix_flags + flags, True
    return name, flags


def base_variant(name: str) -> str:
    """``name`` without its suffixes: ``log-grid+prefetch2`` -> ``log-grid``."""
    return _split_suffixes(name)[0]


def is_variant(name: str) -> bool:
    return base_variant(name) in VARIANTS


def variant_arguments(name: str, ranks_per_node: int) -> list[str]:
    """The ``zeropp train`` flags of variant ``name``."""
    base, suffix_flags = _split_suffixes(name)
    return scheme_flags(named_schemes(ranks_per_node)[base]) + suffix_flags


def _run(spec: ClusterSpec, variant: str, arguments: list[str], out: Path, **launch) -> tuple[dict, dict]:
    """One run over the cluster: (rank 0's summary.json, the cluster's result)."""
    result = run_on_cluster(spec, arguments, timeout_s=3600, **launch)
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


def measure(spec: ClusterSpec, variant: str, train_arguments: list[str], during=None) -> dict:
    """A zeropp variant; ``during(cluster, out)`` runs beside the job (to change the link)."""
    out = Path(tempfile.mkdtemp(prefix="zeropp-throughput-"))
    extra = variant_arguments(variant, spec.ranks_per_node)
    launch = {"during": (lambda cluster: during(cluster, out))} if during else {}
    schedule = out / "schedule.json"
    summary, result = _run(spec, variant, ["train", *train_arguments, *extra, "--out", str(out), "--record-schedule",
                                           str(schedule)], out, **launch)
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
        **_peak_memory(summary),
        "step_s": [row["step_s"] for row in steps],
        "schedule_path": str(schedule),  # rank 0's last step, for the simulator
        **_auto_figures(summary, steps),
    }


def _peak_memory(summary: dict) -> dict:
    """The largest rank's peak resident growth over the run (summaries before it had none)."""
    by_rank = summary.get("peak_rss_increase_bytes_by_rank")
    return {"peak_rss_increase_bytes": max(by_rank)} if by_rank else {}


def _auto_figures(summary: dict, steps: list[dict]) -> dict:
    """Auto mode's decisions, and its tokens/s once the first was made (trials excluded;
    None when it was still trying candidates at the last step)."""
    decisions = summary.get("auto_decisions")
    if decisions is None:  # not auto mode
        return {}
    first = decisions[0]["step"] if decisions else len(steps)
    tokens_per_step = summary["tokens_per_s"] * summary["median_step_s"]
    steady = [row["step_s"] for row in steps[first:]]
    return {"auto_decisions": decisions, "auto_choices": [row.get("auto_choice") for row in steps],
            "trial_steps": first, "steady_tokens_per_s": tokens_per_step / statistics.median(steady) if steady else None}


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DEEPSPEED_PYTHON = Path(__file__).resolve().parents[2] / ".venv-deepspeed" / "bin" / "python"
# Peers on the same cluster and work: variant -> (script in benchmarks/, its --variant).
PEERS = {
    "fsdp2": ("fsdp2_train.py", "plain"),
    "fsdp2-prefetch": ("fsdp2_train.py", "plain-prefetch"),
    "fsdp2-reshard-node": ("fsdp2_train.py", "reshard-node"),
    "fsdp2-hsdp": ("fsdp2_train.py", "hsdp"),
    "fsdp2-hsdp-prefetch": ("fsdp2_train.py", "hsdp-prefetch"),
    "fsdp2-hsdp-kept": ("fsdp2_train.py", "hsdp-kept"),
    "deepspeed-zero3": ("deepspeed_train.py", "zero3"),
    "deepspeed-zero3-small-buckets": ("deepspeed_train.py", "zero3-small-buckets"),
    "deepspeed-zero++": ("deepspeed_train.py", "zero++"),
    "deepspeed-zero++-small-buckets": ("deepspeed_train.py", "zero++-small-buckets"),
}


def check_peers_can_run(variants: list[str]) -> None:
    """A clear error before a benchmark starts, not a failed run per DeepSpeed cell."""
    missing = [variant for variant in variants if variant.startswith("deepspeed") and variant in PEERS]
    if missing and not DEEPSPEED_PYTHON.exists():
        raise ValueError(f"--variants {','.join(missing)} need DeepSpeed's separate environment "
                         f"({DEEPSPEED_PYTHON.parents[1]}): run `make deepspeed-setup` first")


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
        **_peak_memory(summary),
    }
    if "stand_in_quantizer_calls" in summary:
        measured["stand_in_quantizer_calls"] = summary["stand_in_quantizer_calls"]
    return measured


