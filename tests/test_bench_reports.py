"""The benchmark reports: summaries, ratios and tables of the throughput, accumulation and
replan benchmarks, from hand-made runs (no cluster)."""

from __future__ import annotations

import pytest


def test_throughput_ratios_hold_auto_to_its_candidates_and_report_the_quality_setting():
    from zeropp_tools.bench.throughput import ratios

    row = {"zero3": {"tokens_per_s": 100.0}, "zero++": {"tokens_per_s": 400.0}, "auto": {"tokens_per_s": 380.0},
           "zero++-two-hop+prefetch2": {"tokens_per_s": 500.0}, "log-grid+prefetch2": {"tokens_per_s": 360.0},
           "zero++-log-grid": {"tokens_per_s": 392.0}, "fsdp2-hsdp": {"tokens_per_s": 200.0}}
    entry = ratios({"200": row})["200"]
    assert entry["best_fixed"] == "zero++"  # prefetching is the user's choice, not a candidate of auto mode
    assert entry["auto_vs_best_fixed"] == pytest.approx(0.95)
    assert entry["slowest_fixed_vs_zero3"] == pytest.approx(1.0)  # zero3 is the slowest fixed variant here
    assert entry["log-grid+prefetch2_vs_zero++"] == pytest.approx(0.9)
    assert entry["zero++-log-grid_vs_zero++"] == pytest.approx(0.98)
    assert entry["zero++_vs_best_fsdp2"] == pytest.approx(2.0)


def test_throughput_summary_of_auto_runs_still_trying_at_their_last_step():
    from zeropp_tools.bench.throughput import summarize

    decided = {"tokens_per_s": 100.0, "median_step_s": 1.0, "trial_steps": 4, "steady_tokens_per_s": 110.0}
    trying = {"tokens_per_s": 90.0, "median_step_s": 1.1, "trial_steps": 12, "steady_tokens_per_s": None}
    cell = summarize({"none": {"auto": [trying, decided, trying]}})["none"]["auto"]
    assert cell["tokens_per_s"] == 90.0 and cell["tokens_per_s_runs"] == [90.0, 90.0, 100.0]
    assert cell["steady_tokens_per_s"] == 110.0  # from the one run that decided


def test_throughput_table_shows_the_median_runs_peak_memory_where_recorded():
    from zeropp_tools.bench.throughput import markdown, summarize

    runs = {"none": {"zero3": [{"tokens_per_s": rate, "median_step_s": 1.0, "peak_rss_increase_bytes": memory}
                               for rate, memory in ((90.0, 70e6), (100.0, 80e6), (110.0, 95e6))],
                     "zero++": [{"tokens_per_s": 120.0, "median_step_s": 1.0}]}}
    table = markdown({"results": summarize(runs)})
    assert "100 [90-110] (1.00x), 80 MB |" in table and "| 120 (1.20x) |" in table
    assert "peak resident-set growth" in table
    assert "MB" not in markdown({"results": summarize({"none": {"zero3": [{"tokens_per_s": 1.0, "median_step_s": 1.0}]}})})


def test_accumulation_bench_measures_each_cell_once_per_repetition_and_states_the_target_ratios(tmp_path, monkeypatch):
    from zeropp_tools.bench import accumulation

    rates = {("none", 8, "zero3"): 1000.0, ("200", 8, "zero++"): 950.0, ("200", 8, "zero++-every-micro-step"): 400.0,
             ("200", 8, "fsdp2-hsdp"): 500.0}
    measured = []

    def fake(spec, variant, train_arguments):
        bandwidth = "none" if spec.bandwidth_mbit is None else f"{spec.bandwidth_mbit:g}"
        k = int(train_arguments[train_arguments.index("--accumulation") + 1])
        measured.append((bandwidth, k, variant))
        return {"tokens_per_s": rates.get((bandwidth, k, variant), 100.0), "node0_link_rx_payload_bytes": 1}

    monkeypatch.setattr(accumulation, "measure", fake)
    monkeypatch.setattr(accumulation, "measure_peer", fake)
    variants = ["zero++", "zero++-every-micro-step", "fsdp2-hsdp"]
    report = {"layout": "2x2", "train_arguments": ["--steps", "2"], "bandwidths": ["200"], "accumulations": [1, 8],
              "variants": variants, "repetitions": 2, "runs": {"none/8/zero3": [{"tokens_per_s": 1000.0,
                                                                                "node0_link_rx_payload_bytes": 1}]}}
    report = accumulation.run(report, tmp_path)
    # k = 1 has no every-micro-step run (it is node accumulation); the stored run is not repeated.
    assert ("200", 1, "zero++-every-micro-step") not in measured
    assert measured.count(("none", 8, "zero3")) == 1 and measured.count(("200", 8, "zero++")) == 2
    assert len(measured) == 2 * 7 - 1  # limit at k = 1, 8; at 200 Mbit/s two cells at k = 1, three at k = 8
    entry = accumulation.ratios(report)["200/8"]
    assert entry["vs_limit"] == pytest.approx(0.95) and entry["vs_every_micro_step"] == pytest.approx(2.375)
    assert entry["vs_fsdp2-hsdp"] == pytest.approx(1.9)
    assert accumulation.ratios(report)["200/1"]["vs_every_micro_step"] == pytest.approx(1.0)


def test_accumulation_table_shows_peak_memory_beside_speed_where_runs_recorded_it():
    from zeropp_tools.bench import accumulation
    from zeropp_tools.bench.cells import _peak_memory

    assert _peak_memory({"peak_rss_increase_bytes_by_rank": [5e6, 9e6, 7e6, 6e6]}) == {"peak_rss_increase_bytes": 9e6}
    assert _peak_memory({}) == {}  # a summary from before the field
    runs = {"200/8/zero++": [{"tokens_per_s": 900.0, "node0_link_rx_payload_bytes": 1, "peak_rss_increase_bytes": m}
                             for m in (80e6, 90e6, 70e6)],
            "none/8/zero3": [{"tokens_per_s": 1000.0, "node0_link_rx_payload_bytes": 1}]}
    report = {"variants": ["zero++"], "bandwidths": ["200"], "accumulations": [8], "results": accumulation.summarize(runs)}
    assert report["results"]["200/8/zero++"]["peak_rss_increase_bytes"] == 80e6  # the median run
    assert "peak_rss_increase_bytes" not in report["results"]["none/8/zero3"]
    table = accumulation.markdown(report)
    assert "900 [900-900] · 80 MB" in table and "| 1,000 [1,000-1,000] |" in table and "peak resident-set growth" in table


def test_accumulation_bound_hides_one_micro_steps_compute_and_adds_the_rest_of_the_link():
    from zeropp_tools.bench import accumulation
    from zeropp_tools.cluster import payload_bytes_per_s

    rate = payload_bytes_per_s(50)
    # Limit: 8 micro-steps of 0.5 s, 1000 tokens/s. Rank 0 receives 0.75 s of the link's bytes,
    # node 0 (two ranks) 1.5 s: 0.5 s hidden, 1 s added to the 4 s step.
    report = {"layout": "2x2",
              "runs": {"none/8/zero3": [{"tokens_per_s": 1000.0, "median_step_s": 4.0}],
                       "50/8/deltas": [{"tokens_per_s": 700.0, "rank0_inter_node_bytes_per_step": 0.75 * rate}]},
              "results": {"50/8/deltas": {"tokens_per_s": 700.0}, "50/8/zero++-every-micro-step": {"tokens_per_s": 400.0}}}
    bound = accumulation.overlap_bound(report, "50", 8, "deltas")
    assert bound["link_s"] == pytest.approx(1.5) and bound["hidden_s"] == pytest.approx(0.5)
    assert bound["fastest_step_s"] == pytest.approx(5.0) and bound["fastest_tokens_per_s"] == pytest.approx(800.0)
    assert "2.00x reducing every micro-step" in accumulation.bound_markdown(report, "50", 8, "deltas")


def test_accumulation_link_only_rate_and_ratios_of_another_variant():
    from zeropp_tools.bench import accumulation
    from zeropp_tools.cluster import payload_bytes_per_s

    rate = payload_bytes_per_s(50)
    # Every micro-step: 8000 tokens in 8 s; node 0 (two ranks) brings 4 s of the link's bytes,
    # so the link alone allows 2000 tokens/s; deltas at 3000 is 1.5x that.
    every = {"tokens_per_s": 1000.0, "median_step_s": 8.0, "rank0_inter_node_bytes_per_step": 2.0 * rate}
    report = {"layout": "2x2", "bandwidths": ["50"], "accumulations": [8], "variants": ["deltas", "zero++-every-micro-step"],
              "runs": {"50/8/zero++-every-micro-step": [every]},
              "results": {"50/8/deltas": {"tokens_per_s": 3000.0}, "50/8/zero++-every-micro-step": {"tokens_per_s": 1000.0},
                          "none/8/zero3": {"tokens_per_s": 4000.0}}}
    text = accumulation.link_only_markdown(report, "50", 8, "zero++-every-micro-step", "deltas")
    assert "4.00 s" in text and "2,000 tokens/s" in text and "1.50x that" in text
    entry = accumulation.ratios(report, "deltas")["50/8"]
    assert entry == {"vs_limit": pytest.approx(0.75), "vs_every_micro_step": pytest.approx(3.0)}
    assert accumulation.ratios(report) == {}  # zero++ was not run


def test_replan_recovery_counts_medians_of_five_steps_not_one_noisy_step():
    from zeropp_tools.bench.replan import steps_to_recover

    before, after = [0.6] * 15, [1.9, 3.3, 2.1, 2.0, 2.1, 2.0, 2.0, 2.1, 2.4]  # best fixed 2.07 s: limit 2.3 s
    assert steps_to_recover(before + after, 15, 2.07) == 0  # the one 3.3 s step is a median's outlier
    assert steps_to_recover(before + [3.3] * 6 + [2.0] * 10, 15, 2.07) == 4
    assert steps_to_recover(before + [2.0] * 5 + [3.0] * 5, 15, 2.07) is None  # fell back for good
