"""Prefetching several units ahead: the same training, more gathers in flight."""

import torch

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.sharding.flat_param import ShardState


def train_with_prefetch(rank, world_size, prefetch_units):
    topology = Topology.from_environment(ranks_per_node=2)
    torch.manual_seed(0)
    config = ZeroConfig(quantized_weights=True, two_hop_weight_gather=True, hpz_size=2, quantized_gradients=True,
                        quantization_block_size=64, prefetch_units=prefetch_units)
    model = ShardedModel(GPT(GPTConfig(num_layers=4, num_heads=2, embed_dim=64, block_size=64)), topology, config,
                         unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    in_flight = []  # units gathering or gathered right after each prefetch
    prefetch = model._gathering.prefetch

    def counting_prefetch(order, unit, phase):
        prefetch(order, unit, phase)
        in_flight.append(sum(flat.state in (ShardState.GATHERING, ShardState.GATHERED)
                             for other in model.units if not other.is_root for flat in other.flats))

    model._gathering.prefetch = counting_prefetch
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 17), generator=generator)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    masters = torch.cat([flat.master.detach().reshape(-1) for unit in model.units for flat in unit.flats])
    return losses, masters, max(in_flight)


def test_prefetching_two_units_ahead_trains_identically():
    one = spawn_ranks(train_with_prefetch, 4, (1,))
    two = spawn_ranks(train_with_prefetch, 4, (2,))
    for (losses_1, masters_1, in_flight_1), (losses_2, masters_2, in_flight_2) in zip(one, two):
        assert losses_1 == losses_2
        assert torch.equal(masters_1, masters_2)
        # Each block holds one flat: the computing block plus one or two ahead.
        assert in_flight_1 == 2 and in_flight_2 == 3
