"""qgZ's gradient options against plain INT4 on the GPT's real gradients."""

import pytest
import torch

from zeropp_tools.bench.gradient_error import run
from zeropp.quantization import BlockFormat, dequantize, quantize
from zeropp.quantization.hadamard import hadamard, reference_hadamard
from zeropp.reduce.qgz import rounding_seed


def test_hadamard_matches_the_matrix_and_is_its_own_inverse():
    values = torch.randn(4, 96)
    assert torch.allclose(hadamard(values), reference_hadamard(values), atol=1e-5)
    assert torch.allclose(hadamard(hadamard(values)), values, atol=1e-5)


def test_stochastic_rounding_is_unbiased():
    fmt = BlockFormat(4, 32)
    values = torch.linspace(-1, 1, 32)  # most values fall between two levels
    generator = torch.Generator().manual_seed(0)
    mean = torch.stack([dequantize(quantize(values, fmt, generator), fmt, 32) for _ in range(4000)]).mean(0)
    nearest = dequantize(quantize(values, fmt), fmt, 32)
    assert (mean - values).abs().max() < 0.01
    assert (nearest - values).abs().max() > 0.05  # half a step: nearest rounding is biased per value


def test_stochastic_rounding_draws_other_noise_on_every_rank_and_reduction():
    draws = {
        (rank, reduction): torch.rand(8, generator=torch.Generator().manual_seed(rounding_seed(rank, reduction)))
        for rank in range(4) for reduction in range(1, 4)
    }
    for key, values in draws.items():
        for other, other_values in draws.items():
            assert key == other or not torch.equal(values, other_values), (key, other)
    assert rounding_seed(2, 3) == rounding_seed(2, 3)  # repeatable


@pytest.fixture(scope="module")
def errors():
    return run(steps=6)["schemes"]


def test_best_scheme_halves_the_error_the_optimizer_integrates(errors):
    zeropp = errors["int4/int4 (ZeRO++)"]
    best = errors["int8/int4 + error feedback"]  # the same cross-node bytes as ZeRO++
    assert best["cumulative"] * 2 <= zeropp["cumulative"], (best, zeropp)


def test_log_grid_halves_the_error_of_adams_updates(errors):
    zeropp = errors["int4/int4 (ZeRO++)"]
    log_grid = errors["int8/log4"]  # the same cross-node bytes as ZeRO++
    assert log_grid["inter_node_bytes_per_value"] == zeropp["inter_node_bytes_per_value"]
    assert log_grid["adam"] * 2 <= zeropp["adam"], (log_grid, zeropp)


@pytest.mark.parametrize(
    "scheme,metric",
    [("int4/int4 + error feedback", "cumulative"), ("int4/int4 + stochastic", "cumulative"), ("int8/int4", "step")],
)
def test_each_option_beats_plain_int4_where_it_should(errors, scheme, metric):
    assert errors[scheme][metric] < errors["int4/int4 (ZeRO++)"][metric], errors[scheme]


def test_hadamard_keeps_the_true_mean(errors):
    # On these gradients rotation does not lower the error (it mixes the many near-zero
    # values with the large ones), but the result is still the mean within INT4 error.
    assert errors["int4/int4 + hadamard32"]["step"] < 0.2


def test_bf16_scales_on_128_blocks_cost_the_same_bytes_and_err_less(errors):
    zeropp = errors["int4/int4 (ZeRO++)"]
    smaller_blocks = errors["int4/int4, 128 blocks, bf16 scales"]
    assert smaller_blocks["inter_node_bytes_per_value"] == zeropp["inter_node_bytes_per_value"]
    assert smaller_blocks["step"] < zeropp["step"], (smaller_blocks, zeropp)
