"""Stored per-step losses of two small fixed runs: a change that alters the numerics of
ZeRO-3 or of the ZeRO++ path fails here. After an intended change, regenerate with

    ZEROPP_REGENERATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

import os
from dataclasses import replace
from pathlib import Path

import pytest

from zeropp import ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.train import TrainConfig, train

GOLDEN = Path(__file__).parent / "golden"
BASE = TrainConfig(model_size="tiny", steps=20, batch_per_rank=4, seq_len=64, eval_every=20, ranks_per_node=2)
RUNS = {
    "zero3_tiny_2x2": ZeroConfig(),
    "zeropp_tiny_2x2": ZeroConfig(
        quantized_weights=True, hpz_size=2, quantized_gradients=True, quantization_block_size=64,
        gradient_bits_intra_node=8, gradient_error_feedback=True,
    ),
}


def run_all(rank, world_size):
    return {name: train(rank, world_size, replace(BASE, zero=zero))["losses"] for name, zero in RUNS.items()}


def read_golden(name):
    lines = (GOLDEN / f"{name}.txt").read_text().splitlines()
    return [float(line.split()[1]) for line in lines]


@pytest.fixture(scope="module")
def losses():
    return spawn_ranks(run_all, 4)[0]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_losses_match_the_stored_run(losses, name):
    if os.environ.get("ZEROPP_REGENERATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        (GOLDEN / f"{name}.txt").write_text("".join(f"{step} {loss!r}\n" for step, loss in enumerate(losses[name])))
    golden = read_golden(name)
    assert len(golden) == len(losses[name]) == BASE.steps
    for step, (stored, now) in enumerate(zip(golden, losses[name])):
        assert abs(now - stored) <= 1e-6 * abs(stored), (name, step, stored, now)
