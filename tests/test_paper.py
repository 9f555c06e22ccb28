"""The ZeRO++ paper's rows: how the simulation is counted against them, and what the
published figures imply by themselves (zeropp_tools/simulation/paper.py)."""

import pytest


def test_the_paper_summary_counts_the_listed_rows_apart_from_the_others():
    from zeropp_tools.simulation.paper import OTHER_PUBLISHED, PUBLISHED, paper_markdown, paper_summary

    def entry(row, zero3, zeropp):
        return {"row": {"model": row.model, "adapters": row.adapters, "tokens_per_gpu": row.tokens_per_gpu,
                        "published": list(row.published)},  # as the JSON gives it back
                "zero3": {"tflops": zero3, "bottleneck": "compute"}, "zero++": {"tflops": zeropp, "bottleneck": "compute"}}

    # The first listed row exact; the others off by 20% on ZeRO++ (so their speedup is too).
    rows = [entry(row, *row.published) for row in PUBLISHED[:1]]
    rows += [entry(row, row.published[0], 1.2 * row.published[1]) for row in (*PUBLISHED[1:], *OTHER_PUBLISHED)]
    rows.reverse()  # the listed rows are told by their content, not their position
    summary = paper_summary({"rows": rows})
    assert summary == {"rows": 4, "tflops_within_15_percent": 1, "speedup_within_10_percent": 1,
                       "other_rows": len(OTHER_PUBLISHED), "other_tflops_within_15_percent": 0,
                       "other_speedup_within_10_percent": 0}
    assert len(paper_markdown({"rows": rows}, listed_only=True).splitlines()) == 2 + 4


def test_published_figures_made_of_one_rate_plus_a_fixed_time_give_both_back():
    from zeropp_tools.simulation.paper import MODELS, VOCABULARY, Row, implied_by_published

    layers, hidden = MODELS["18B"]
    flops_per_token = 8 * (12 * layers * hidden * hidden + VOCABULARY * hidden)

    def tflops(tokens, rate, fixed_s):  # what a step of compute at ``rate`` plus ``fixed_s`` reads as
        return flops_per_token * tokens / (flops_per_token * tokens / rate + fixed_s) / 1e12

    rows = tuple(Row("18B", 4, tokens, (tflops(tokens, 60e12, 2.0), tflops(tokens, 90e12, 0.5)))
                 for tokens in (1024, 2048)) + (Row("18B", 2, 2048, (37, 50)),)  # no 1K row: left out
    zero3, zeropp = implied_by_published(rows)
    assert zero3["scheme"] == "zero3" and zero3["marginal_flops"] == pytest.approx(60e12)
    assert zero3["not_compute_1k_s"] == pytest.approx(2.0)
    assert zeropp["marginal_flops"] == pytest.approx(90e12) and zeropp["not_compute_1k_s"] == pytest.approx(0.5)
    assert zero3["step_1k_s"] == pytest.approx(flops_per_token * 1024 / 60e12 + 2.0)
