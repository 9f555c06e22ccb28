"""qwZ, hpZ and qgZ collectives against plain collectives: same layout, bounded error,
and for qgZ the true mean."""

import pytest
import torch

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.accounting import CommLog
from zeropp.collectives import Communicator
from zeropp.collectives.reference import reference_reduce_scatter_mean
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.reduce import QgzReduction

BLOCK = 64


def gathered_weights(rank, world_size, ranks_per_node, compute_dtype):
    """Full buffers of every flat, gathered plainly, with qwZ, and again from hpZ."""
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    results = {}
    for name, options in {
        "plain": dict(shard_alignment=BLOCK),
        "qwz": dict(quantized_weights=True, hpz_size=ranks_per_node),
        "hpz": dict(hpz_size=ranks_per_node, shard_alignment=BLOCK),
    }.items():
        torch.manual_seed(0)
        config = ZeroConfig(compute_dtype=compute_dtype, quantization_block_size=BLOCK, **options)
        model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, config, unit_classes=(Block,))
        first, again = [], []
        for unit in model.units:
            model._gathering.ensure(unit, "forward_gather")  # from the primary shards
            first.append([flat.full_data.float().clone() for flat in unit.flats])
            model._gathering.free(unit)
            model._gathering.ensure(unit, "forward_gather")  # from the secondary partition when hpZ is on
            again.append([flat.full_data.float().clone() for flat in unit.flats])
            model._gathering.free(unit)
        results[name] = (first, again, model.comm_log.totals_by_phase())
    return results


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16", "fp16"])
def test_qwz_and_hpz_gathers_match_plain(compute_dtype):
    world_size, ranks_per_node = 4, 2
    for result in spawn_ranks(gathered_weights, world_size, (ranks_per_node, compute_dtype)):
        plain, _, _ = result["plain"]
        quantized, quantized_again, _ = result["qwz"]
        hpz_first, hpz_again, _ = result["hpz"]
        for unit_plain, unit_q, unit_q_again, unit_h, unit_h_again in zip(plain, quantized, quantized_again, hpz_first, hpz_again):
            for exact, approx, approx_again, h_first, h_again in zip(unit_plain, unit_q, unit_q_again, unit_h, unit_h_again):
                # hpZ backward weights are exactly the forward's, with and without qwZ.
                assert torch.equal(approx, approx_again)
                assert torch.equal(h_first, exact) and torch.equal(h_again, exact)
                # Blocks tile each rank's shard, so each block's bound is its own absmax.
                blocks = exact.view(-1, BLOCK)
                bound = blocks.abs().amax(dim=1, keepdim=True) / 127 / 2
                if compute_dtype != "fp32":
                    # Both sides were rounded to the compute dtype once (8 or 11 significant bits).
                    relative = 2**-7 if compute_dtype == "bf16" else 2**-10
                    bound = bound * 1.01 + (blocks.abs() + bound) * relative
                assert ((approx.view(-1, BLOCK) - blocks).abs() <= bound * 1.0001).all()


def test_hpz_gathers_never_cross_nodes():
    for result in spawn_ranks(gathered_weights, 4, (2, "fp32")):
        for name in ("qwz", "hpz"):
            totals = result[name][2]["forward_gather"]
            plain = result["plain"][2]["forward_gather"]
            crossing = totals["received_inter_node"] + totals["sent_inter_node"]
            plain_crossing = plain["received_inter_node"] + plain["sent_inter_node"]
            # First gathers cross nodes, the repeats stay inside the node: half of plain's.
            assert 0 < crossing <= plain_crossing / 2 + 1


def reduce_both_ways(rank, world_size, ranks_per_node, bits, shard):
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    communicator = Communicator(CommLog(topology.layout, rank))
    generator = torch.Generator().manual_seed(rank)
    common = torch.randn(world_size * shard, generator=torch.Generator().manual_seed(99))
    # Every rank holds the same signal plus its own noise, so the mean is far from zero
    # and a result off by a factor (D, W, N) is far outside the error bound.
    flat = common + 0.3 * torch.randn(world_size * shard, generator=generator)
    config = ZeroConfig(quantized_gradients=True, quantization_block_size=BLOCK, gradient_chunks=2,
                        gradient_bits_intra_node=bits[0], gradient_bits_inter_node=bits[1])
    pending = QgzReduction(config, topology, communicator).start(flat)
    pending.progress()
    quantized = pending.wait()
    exact = reference_reduce_scatter_mean(flat, topology.group("world"), rank)
    return quantized, exact, flat.abs().max().item(), communicator.comm_log.totals()


@pytest.mark.parametrize(
    "world_size,ranks_per_node,bits",
    [(4, 2, (4, 4)), (4, 2, (8, 4)), (4, 4, (4, 4)), (4, 1, (4, 4)), (3, 3, (4, 4)), (3, 1, (4, 4))],
)
def test_qgz_equals_reduce_scatter_within_bound(world_size, ranks_per_node, bits):
    shard = BLOCK * 4
    for quantized, exact, largest, _ in spawn_ranks(reduce_both_ways, world_size, (ranks_per_node, bits, shard)):
        assert quantized.shape == exact.shape == (shard,)
        # Each hop rounds each value by at most half a step of its block: absmax / (2 * max_code).
        # Hop 1 sees inputs (<= largest); hop 2 sees node sums (<= D * largest), then / W.
        nodes = world_size // ranks_per_node
        hop1 = largest / (2 * (2 ** (bits[0] - 1) - 1)) if ranks_per_node > 1 else 0.0
        hop2 = ranks_per_node * largest / (2 * (2 ** (bits[1] - 1) - 1)) if nodes > 1 else 0.0
        bound = (world_size * hop1 + nodes * hop2) / world_size
        assert (quantized - exact).abs().max() <= bound * 1.001
        relative = (quantized - exact).norm() / exact.norm()
        assert relative < 0.15, relative  # far below the 100% error of a mean off by D


def test_qgz_crosses_nodes_with_quarter_bytes():
    shard = BLOCK * 4
    for _, _, _, totals in spawn_ranks(reduce_both_ways, 4, (2, (4, 4), shard)):
        plain_inter = shard * 2 * 2  # bf16 reduce-scatter: 2 peers on the other node
        packed = shard // 2 + shard // BLOCK * 4  # one peer, INT4 codes plus fp32 scales
        assert totals["received_inter_node"] == packed
        assert packed <= 0.27 * plain_inter


def reduce_small_values(rank, world_size, grid):
    topology = Topology.from_environment(ranks_per_node=2)
    communicator = Communicator(CommLog(topology.layout, rank))
    # The same values on every rank, their sizes spread over three decades inside each block.
    generator = torch.Generator().manual_seed(5)
    shard = BLOCK * 4
    sizes = torch.logspace(-3, 0, BLOCK)[torch.randperm(BLOCK, generator=generator)].repeat(world_size * 4)
    flat = sizes * torch.randn(world_size * shard, generator=generator).sign()
    config = ZeroConfig(quantized_gradients=True, quantization_block_size=BLOCK, gradient_chunks=2,
                        gradient_bits_intra_node=8, gradient_grid_inter_node=grid)
    result = QgzReduction(config, topology, communicator).start(flat).wait()
    return result, flat[rank * shard : (rank + 1) * shard]


def test_log_grid_keeps_the_size_of_small_gradients():
    kept, zeroed = {}, {}
    for grid in ("uniform", "log"):
        for result, exact in spawn_ranks(reduce_small_values, 4, (grid,)):
            above = exact.abs() >= exact.abs().max() / 32  # values within five factors of 2 of the largest
            close = ((result - exact).abs() <= 0.5 * exact.abs())[above].float().mean().item()
            kept[grid] = min(kept.get(grid, 1.0), close)
            zeroed[grid] = max(zeroed.get(grid, 0.0), (result[above] == 0).float().mean().item())
    # Every such value keeps its size to within a half on powers of two; a uniform 4-bit
    # grid rounds the ones under absmax / 14 to 0 (about a quarter of them here).
    assert kept["log"] == 1.0 and zeroed["log"] == 0.0, (kept, zeroed)
    assert zeroed["uniform"] > 0.15 and kept["uniform"] < 0.8, (kept, zeroed)


def reduce_eager_and_compiled(rank, world_size):
    topology = Topology.from_environment(ranks_per_node=2)
    communicator = Communicator(CommLog(topology.layout, rank))
    generator = torch.Generator().manual_seed(rank)
    flat = torch.randn(world_size * BLOCK * 4, generator=generator) * torch.logspace(-4, 0, world_size * BLOCK * 4)
    results = []
    for compiled in (False, True):
        config = ZeroConfig(quantized_gradients=True, quantization_block_size=BLOCK, gradient_chunks=2,
                            gradient_bits_intra_node=8, gradient_grid_inter_node="log", compile_quantization=compiled)
        results.append(QgzReduction(config, topology, communicator).start(flat).wait())
    return torch.equal(*results)


def test_compiled_qgz_with_the_log_grid_equals_eager():
    assert all(spawn_ranks(reduce_eager_and_compiled, 4, ()))
