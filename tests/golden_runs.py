"""The two small fixed runs whose per-step losses are stored in tests/golden/, shared by
the golden test and by the script that measures how far CPU kernels move them.

Measure the spread (each ``ATEN_CPU_CAPABILITY`` this CPU supports, in a fresh process)::

    .venv/bin/python tests/golden_runs.py --out tests/golden/spread.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from zeropp import ZeroConfig
from zeropp.data import load_stdlib_corpus
from zeropp.launch import spawn_ranks
from zeropp.train import TrainConfig, train

GOLDEN = Path(__file__).parent / "golden"
CORPUS_HASH = GOLDEN / "corpus.sha256"
BASE = TrainConfig(model_size="tiny", steps=20, batch_per_rank=4, seq_len=64, eval_every=20, ranks_per_node=2)
RUNS = {
    "zero3_tiny_2x2": ZeroConfig(),
    "zeropp_tiny_2x2": ZeroConfig(
        quantized_weights=True, hpz_size=2, quantized_gradients=True, quantization_block_size=64,
        gradient_bits_intra_node=8, gradient_error_feedback=True,
    ),
}
CAPABILITIES = ("default", "avx2", "avx512")  # what ATen dispatches to on x86-64


def _run_all(rank, world_size):
    return {name: train(rank, world_size, replace(BASE, zero=zero))["losses"] for name, zero in RUNS.items()}


def run_golden_losses() -> dict[str, list[float]]:
    """Per-step losses of every golden run (4 ranks as 2 nodes x 2)."""
    return spawn_ranks(_run_all, 4)[0]


def corpus_hash() -> str:
    """SHA-256 of the corpus the runs train on: the standard library of this Python."""
    return hashlib.sha256(load_stdlib_corpus().numpy().tobytes()).hexdigest()


def read_golden(name: str) -> list[float]:
    lines = (GOLDEN / f"{name}.txt").read_text().splitlines()
    return [float(line.split()[1]) for line in lines]


def write_golden(losses: dict[str, list[float]]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name, values in losses.items():
        (GOLDEN / f"{name}.txt").write_text("".join(f"{step} {loss!r}\n" for step, loss in enumerate(values)))
    CORPUS_HASH.write_text(corpus_hash() + "\n")


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _losses_under(capability: str) -> tuple[str, dict[str, list[float]]]:
    """Run the golden runs in a fresh process with ``ATEN_CPU_CAPABILITY=capability``; return
    the capability torch actually used (lower when the CPU lacks the requested one)."""
    code = ("import json, torch, golden_runs; "
            "print(json.dumps([torch.backends.cpu.get_cpu_capability(), golden_runs.run_golden_losses()]))")
    environment = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), environment.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    used, losses = json.loads(result.stdout.strip().splitlines()[-1])
    return used, losses


def measure_spread() -> dict:
    """Each run's largest relative loss difference between any two capabilities, and from
    the stored golden."""
    by_capability = {}
    for capability in CAPABILITIES:
        used, losses = _losses_under(capability)
        if used.lower() != capability:
            continue  # this CPU cannot run it; torch fell back to a lower one
        by_capability[capability] = losses
    spread = {}
    for name in RUNS:
        runs = [losses[name] for losses in by_capability.values()]
        between = max((largest_relative_difference(a, b) for a in runs for b in runs if a is not b), default=0.0)
        stored = max(largest_relative_difference(run, read_golden(name)) for run in runs)
        spread[name] = {"between_capabilities": between, "from_stored_golden": stored}
    return {"capabilities": sorted(by_capability), "spread": spread, "losses": by_capability,
            "machine": _machine(), "torch": torch.__version__, "corpus_sha256": corpus_hash()}


def _machine() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the report here as JSON")
    args = parser.parse_args()
    report = measure_spread()
    for name, row in report["spread"].items():
        print(f"{name}: between capabilities {row['between_capabilities']:.2e}, "
              f"from stored golden {row['from_stored_golden']:.2e} ({', '.join(report['capabilities'])})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
