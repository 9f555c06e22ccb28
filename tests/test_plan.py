"""The planner: its byte counts are the tested analytic volume, and its advice is sane."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from zeropp.config import ZeroConfig
from zeropp_tools.plan import ClusterModel, compare, gpt_work, predict, recommend


def test_planner_bytes_equal_the_measured_volume():
    # benchmarks/results/comm.json: node 0's measured inbound bytes per step, GPT small with
    # 64 positions, 2x2, bf16.
    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/comm.json").read_text())
    _, predictions = recommend(gpt_work("small", 256, 5e9, block_size=64), ClusterModel(2, 2, 25e6))
    for variant, prediction in predictions.items():
        assert prediction["inter_node_bytes_per_step"] == measured["layouts"]["2x2"][variant]["measured"]["inter_node"]


def test_slow_links_favour_zeropp_and_fast_links_close_the_gap():
    work = gpt_work("small", 256, 5e9)
    slow_best, slow = recommend(work, ClusterModel(2, 2, 50e6 / 8))
    _, fast = recommend(work, ClusterModel(2, 2, 100e9 / 8))
    assert slow_best == "zero++"
    assert slow["zero++"]["step_s"] < 0.5 * slow["zero3"]["step_s"]
    assert fast["zero++"]["step_s"] > 0.9 * fast["zero3"]["step_s"]


def _report(unshaped_step_s: float, shaped: dict[str, float]) -> dict:
    """A `zeropp bench throughput` report for GPT tiny on 2x2, ZeRO-3 only."""
    results = {"none": {"zero3": {"median_step_s": unshaped_step_s}}}
    results.update({bandwidth: {"zero3": {"median_step_s": step}} for bandwidth, step in shaped.items()})
    return {"layout": "2x2", "results": results,
            "train_arguments": ["--model", "tiny", "--batch-per-rank", "4", "--seq-len", "64"]}


def test_comparison_calibrates_compute_on_the_unshaped_run_and_adds_the_link():
    rows = compare(_report(0.2, {"1000000": 0.2, "1": 100.0}))
    fast, slow = rows
    assert abs(fast["predicted_step_s"] - 0.2) < 0.01 * 0.2  # a link this fast adds nothing
    bf16 = ZeroConfig(compute_dtype="bf16", reduce_dtype="bf16")
    bytes_per_step = predict(gpt_work("tiny", 256, 1.0), ClusterModel(2, 2, 1e6 / 8), bf16)["inter_node_bytes_per_step"]
    assert slow["predicted_step_s"] > bytes_per_step / (1e6 / 8)  # a slow link dominates
    assert abs(slow["error_percent"] - (slow["predicted_step_s"] - 100.0) / 100.0 * 100) < 1e-9


def test_planner_within_25_percent_of_the_stored_emulated_runs():
    stored = json.loads((Path(__file__).parents[1] / "benchmarks/results/throughput/auto/throughput.json").read_text())
    rows = compare(stored)
    assert len(rows) >= 6
    worst = max(rows, key=lambda row: abs(row["error_percent"]))
    assert abs(worst["error_percent"]) <= 25, worst


def test_accumulation_spreads_one_crossing_of_the_gradients_over_k_micro_steps():
    one = gpt_work("small", 256, 5e9)
    eight = replace(one, accumulation=8)
    slow = ClusterModel(2, 2, 10e6 / 8)  # link-bound at k = 1
    _, per_micro_step = recommend(one, slow)
    best, per_eight = recommend(eight, slow)
    assert per_eight["zero++"]["compute_s"] == pytest.approx(8 * per_micro_step["zero++"]["compute_s"])
    # hpZ's copy and the node sums: an optimizer step of eight crosses nodes as one of one does
    assert per_eight["zero++"]["inter_node_bytes_per_step"] == per_micro_step["zero++"]["inter_node_bytes_per_step"]
    assert per_eight["zero++"]["tokens_per_s"] > 3 * per_micro_step["zero++"]["tokens_per_s"]
    assert per_eight["zero3"]["inter_node_bytes_per_step"] > 4 * per_micro_step["zero3"]["inter_node_bytes_per_step"]
    assert best in ("zero++", "zero++-two-hop")
