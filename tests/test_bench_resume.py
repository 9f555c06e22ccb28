"""The throughput benchmark across sittings: what --resume measures again, and what it
refuses before it starts."""

import json

import pytest


def test_a_resumed_throughput_benchmark_measures_only_the_missing_runs(tmp_path, monkeypatch):
    from zeropp_tools.bench import throughput

    measured = []

    def fake_measure(spec, variant, train_arguments):
        measured.append((spec.bandwidth_mbit, variant))
        return {"tokens_per_s": 100.0, "median_step_s": 1.0}

    monkeypatch.setattr(throughput, "measure", fake_measure)
    done = {"tokens_per_s": 50.0, "median_step_s": 2.0}
    known = {"runs": {"none": {"zero3": [done, done], "zero++": [done]}, "200": {"zero3": [done], "zero++": []}},
             "provenance": {"git_commit": "first"}}
    report = throughput.run(2, 2, ["none", "200"], ["zero3", "zero++"], ["--steps", "2"], tmp_path, 2, known)
    assert sorted(measured, key=str) == sorted([(None, "zero++"), (200.0, "zero3"), (200.0, "zero++"), (200.0, "zero++")],
                                               key=str)
    assert all(len(row[variant]) == 2 for row in report["runs"].values() for variant in row)
    assert report["provenance"] == {"git_commit": "first"} and "resumed_provenance" in report
    assert json.loads((tmp_path / "throughput.json").read_text())["runs"] == report["runs"]


def test_a_resumed_throughput_benchmark_measures_a_failed_run_again_and_keeps_its_error(tmp_path, monkeypatch):
    from zeropp_tools.bench import throughput

    measured = []
    monkeypatch.setattr(throughput, "measure", lambda spec, variant, arguments: measured.append(variant) or
                        {"tokens_per_s": 100.0, "median_step_s": 1.0})
    failed = {"error": "the cluster did not start"}
    known = {"runs": {"none": {"zero3": [failed, {"tokens_per_s": 50.0, "median_step_s": 2.0}]}}}
    report = throughput.run(2, 2, ["none"], ["zero3"], ["--steps", "2"], tmp_path, 2, known)
    assert measured == ["zero3"]  # one of the two repetitions failed: measured once more
    assert report["runs"]["none"]["zero3"][0] == failed and report["results"]["none"]["zero3"]["tokens_per_s"] == 75.0


def test_a_deepspeed_peer_without_its_environment_is_an_error_before_the_benchmark(monkeypatch, tmp_path):
    from zeropp_tools.bench import cells

    monkeypatch.setattr(cells, "DEEPSPEED_PYTHON", tmp_path / "missing" / "bin" / "python")
    cells.check_peers_can_run(["zero3", "fsdp2-hsdp"])
    with pytest.raises(ValueError, match="--variants deepspeed-zero\\+\\+ need DeepSpeed's separate environment"):
        cells.check_peers_can_run(["zero3", "deepspeed-zero++"])
