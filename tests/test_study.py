"""The convergence study's choice of runs and its checks on --variants and --layout (no training)."""

import argparse

import pytest

from zeropp.train import TrainConfig
from zeropp_tools.study import convergence


def test_selected_variants_run_at_every_seed_with_hpz_over_the_node():
    base = TrainConfig(model_size="small", steps=100, ranks_per_node=1)
    runs = convergence._runs([0, 1], base, ["zero3", "zero++", "deltas"])
    assert [(name, seed) for name, seed, _ in runs] == [
        (convergence.BASELINE, 0), (convergence.ZERO_PP_NAME, 0), (convergence.DELTAS_NAME, 0),
        (convergence.BASELINE, 1), (convergence.ZERO_PP_NAME, 1), (convergence.DELTAS_NAME, 1)]
    assert runs[1][2].hpz_size == 1  # one rank per node: no hpZ
    everything = convergence._runs([0, 1], TrainConfig(model_size="small", steps=100, ranks_per_node=2), None)
    main, extra = convergence._variants(100, 2)
    assert len(everything) == 2 * len(main) + len(extra)
    assert {zero.compute_dtype for _, _, zero in everything} == {"fp32"}


def test_every_run_computes_in_the_chosen_precision():
    base = TrainConfig(model_size="medium", steps=100, ranks_per_node=2)
    runs = convergence._runs([0], base, ["zero3", "zero++", "deltas"], compute_dtype="bf16")
    assert [zero.compute_dtype for _, _, zero in runs] == ["bf16"] * 3
    assert runs[2][2].weight_deltas and runs[1][2].quantized_weights  # the variants keep their schemes


def test_the_table_states_resting_memory_where_runs_recorded_it():
    config = {"zero": {}, "model_size": "small", "batch_per_rank": 1, "seq_len": 8, "ranks_per_node": 2,
              "steps": 10}
    run = {"validation_loss": 2.0, "config": config, "world_size": 4}
    results = {convergence.BASELINE: {0: run}, convergence.DELTAS_NAME: {0: dict(run, resting_bytes_per_rank=5e6)}}
    table = convergence._markdown(convergence._table(results))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows[convergence.DELTAS_NAME].endswith("| 5.00 |")
    assert rows[convergence.BASELINE].endswith("| - |")


@pytest.mark.parametrize("variants,message", [("zero3,fast", "--variants"), ("zero++,deltas", "zero3")])
def test_bad_variants_are_named(variants, message):
    arguments = argparse.Namespace(seeds="0", layout="2x2", variants=variants, model="small", steps=10,
                                   batch_per_rank=1, seq_len=8, lr=1e-3, eval_every=5, eval_batches=1,
                                   out="unused", report_only=True, precision="fp32")
    with pytest.raises(ValueError, match=message):
        convergence.main(arguments)


def test_summaries_stored_under_a_renamed_field_still_report():
    config = {"zero": {"hierarchical_weight_gather": True, "quantized_weights": True, "weight_bits": 12},
              "model_size": "small", "batch_per_rank": 8, "seq_len": 128, "ranks_per_node": 2, "steps": 1500}
    renamed = dict(config, zero={"two_hop_weight_gather": True, "quantized_weights": True, "weight_bits": 12})
    assert convergence._node_link_bytes(config) == convergence._node_link_bytes(renamed) > 0
