"""The planner: its byte counts are the tested analytic volume, and its advice is sane."""

import json
from pathlib import Path

from zeropp.plan import Cluster, gpt_work, paper_predictions, recommend


def test_planner_bytes_equal_the_measured_volume():
    # benchmarks/results/comm.json: node 0's measured inbound bytes per step, GPT small with
    # 64 positions, 2x2, bf16.
    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/comm.json").read_text())
    _, predictions = recommend(gpt_work("small", 256, 5e9, block_size=64), Cluster(2, 2, 25e6))
    for variant, prediction in predictions.items():
        assert prediction["inter_node_bytes_per_step"] == measured["layouts"]["2x2"][variant]["measured"]["inter_node"]


def test_slow_links_favour_zeropp_and_fast_links_close_the_gap():
    work = gpt_work("small", 256, 5e9)
    slow_best, slow = recommend(work, Cluster(2, 2, 50e6 / 8))
    _, fast = recommend(work, Cluster(2, 2, 100e9 / 8))
    assert slow_best == "zero++"
    assert slow["zero++"]["step_s"] < 0.5 * slow["zero3"]["step_s"]
    assert fast["zero++"]["step_s"] > 0.9 * fast["zero3"]["step_s"]


def test_paper_setting_prediction_covers_every_model_and_bandwidth():
    report = paper_predictions()
    assert len(report) == 8
    for row in report.values():
        assert row["tflops_per_gpu"]["zero++"] >= row["tflops_per_gpu"]["zero3"]
