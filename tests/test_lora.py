"""LoRA adapters trained sharded: the frozen base (INT8 and resident in the node under
MixZ++) and the trainable adapters; parity with the unsharded adapted model."""

import torch
from parity import train_step

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig, add_lora

STEPS = 5


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    add_lora(model, ("qkv", "proj"), rank=4)
    torch.manual_seed(1)
    for name, param in model.named_parameters():  # non-zero B, so the adapters matter from step 0
        if name.endswith("up.weight"):
            param.data.normal_(0.0, 0.02)
    return model


def batch(step):
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def reference():
    model = build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, sum(p.numel() for p in trainable)


def sharded(rank, world_size, options):
    model = ShardedModel(build(), Topology.from_environment(ranks_per_node=2), ZeroConfig(**options),
                         unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    losses, crossings = [], []
    for step in range(STEPS):
        model.comm_log.reset()
        inputs, targets = batch(step)
        losses.append(train_step(model, optimizer, inputs[rank : rank + 1], targets[rank : rank + 1]))
        crossings.append(model.comm_log.totals_by_phase()["forward_gather"]["received_inter_node"])
    trainable = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad)
    return losses, crossings, trainable, model.predicted_step_bytes()["forward_gather"]["received_inter_node"]


def test_lora_trains_sharded_like_the_unsharded_model():
    want, adapter_numel = reference()
    results = spawn_ranks(sharded, 4, ({},))
    assert sum(trainable for _, _, trainable, _ in results) == adapter_numel  # pieces of the adapters only
    for losses, _, _, _ in results:
        assert all(abs(g - w) <= 1e-5 * w for g, w in zip(losses, want)), (losses, want)


def test_under_mixzpp_the_frozen_base_stays_in_the_node():
    want, _ = reference()
    results = spawn_ranks(sharded, 4, (dict(hpz_size=2, quantized_nontrainable_weights=True),))
    for rank, (losses, crossings, _, predicted) in enumerate(results):
        assert all(abs(g - w) <= 2e-2 * w for g, w in zip(losses, want)), (losses, want)
        assert crossings[1:] == [predicted] * (STEPS - 1)  # only the adapters and the root cross
        if rank % 2 == 0:
            assert crossings[0] > crossings[1]  # the INT8 base, once
