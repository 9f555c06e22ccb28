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


@pytest.mark.parametrize("variants,message", [("zero3,fast", "--variants"), ("zero++,deltas", "zero3")])
def test_bad_variants_are_named(variants, message):
    arguments = argparse.Namespace(seeds="0", layout="2x2", variants=variants, model="small", steps=10,
                                   batch_per_rank=1, seq_len=8, lr=1e-3, eval_every=5, eval_batches=1,
                                   out="unused", report_only=True)
    with pytest.raises(ValueError, match=message):
        convergence.main(arguments)
