"""fp16 compute trains with dynamic loss scaling: the same losses as fp32 to fp16 accuracy,
the scale backs off on overflow and grows after good steps, and forgetting to scale the
loss is an error instead of silently wrong gradients."""

import pytest
import torch

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.optim.loss_scale import DynamicLossScale

STEPS = 8


def train(rank, world_size, compute_dtype, scale_the_loss=True):
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), Topology.from_environment(ranks_per_node=2),
                         ZeroConfig(compute_dtype=compute_dtype), unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=3e-3))
    losses, scales = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        (optimizer.scale_loss(loss) if scale_the_loss else loss).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(optimizer.loss_scale.scale if optimizer.loss_scale else None)
    return losses, scales, optimizer.skipped_steps


def test_fp16_with_loss_scaling_follows_fp32():
    fp32 = spawn_ranks(train, 2, ("fp32",))
    fp16 = spawn_ranks(train, 2, ("fp16",))
    for (exact, no_scale, _), (half, scales, skipped) in zip(fp32, fp16):
        assert no_scale == [None] * STEPS and scales[0] is not None
        for step, (a, b) in enumerate(zip(exact, half)):
            # fp16 rounding, and one step behind after a skipped overflow step: within 3%
            assert abs(a - b) <= 0.03 * a, (step, exact, half)
        # An overflowed step is skipped and halves the scale (here the first step at 2^16).
        assert skipped <= 2 and scales[-1] == 2.0**16 * 0.5**skipped, (skipped, scales)


def test_forgetting_to_scale_the_loss_is_named():
    with pytest.raises(ValueError, match=r"optimizer.scale_loss\(loss\).backward\(\)"):
        spawn_ranks(train, 2, ("fp16", False))


def test_scale_backs_off_on_overflow_and_grows_after_good_steps():
    scale = DynamicLossScale(scale=1024.0, growth_interval=3)
    scale.update(overflowed=True)
    assert scale.scale == 512.0
    for _ in range(3):
        scale.update(overflowed=False)
    assert scale.scale == 1024.0 and scale.good_steps == 0
    floor = DynamicLossScale(scale=1.0)
    floor.update(overflowed=True)
    assert floor.scale == 1.0
