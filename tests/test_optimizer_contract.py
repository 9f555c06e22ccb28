"""ShardedOptimizer is a torch.optim.Optimizer: learning-rate schedulers drive it, and the
learning rate they set is the one the inner optimizer steps with."""

import torch

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

STEPS = 6


def schedule(step: int) -> float:
    return 0.5 ** step


def reference() -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def sharded(rank, world_size):
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), Topology.from_environment(ranks_per_node=2), ZeroConfig(),
                         unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.SGD(params, lr=0.5))
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses, rates = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
        rows = slice(rank * 2, rank * 2 + 2)
        loss = model(tokens[rows, :-1], tokens[rows, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
        rates.append(optimizer.optimizer.param_groups[0]["lr"])
    return losses, rates


def test_lambda_lr_drives_the_sharded_optimizer():
    expected = reference()
    for losses, rates in spawn_ranks(sharded, 2):
        assert rates == [0.5 * schedule(step + 1) for step in range(STEPS)]
        for got, want in zip(losses, expected):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, expected)
