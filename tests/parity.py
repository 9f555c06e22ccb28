"""Training loops shared by the parity tests: a single-process reference and the sharded
run, fed the same global batches (each rank takes its rows of every micro-batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.models import GPT, Block, GPTConfig

STEPS = 20
ROWS_PER_RANK = 2
SEQ_LEN = 32


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str = "gpt"  # "gpt" or "encoder" (torch.nn.TransformerEncoder)
    accumulation: int = 1
    clip: float | None = None
    freeze: bool = False
    checkpointing: bool = False
    hpz: bool = False  # secondary partition over the node's ranks, no quantization


SCENARIOS = [
    Scenario("plain"),
    Scenario("accumulation", accumulation=2),
    Scenario("clipping", clip=0.05),
    Scenario("frozen", freeze=True),
    Scenario("checkpointing", checkpointing=True),
    Scenario("encoder", model="encoder", clip=0.5),
    Scenario("hpz", hpz=True),
    Scenario("hpz_accumulation_checkpointing_frozen", hpz=True, accumulation=2, checkpointing=True, freeze=True),
]


def build_model(scenario: Scenario) -> tuple[nn.Module, tuple[type, ...]]:
    torch.manual_seed(0)
    if scenario.model == "encoder":
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        units = (nn.TransformerEncoderLayer,)
    else:
        model = GPT(GPTConfig.preset("tiny"))
        units = (Block,)
    if scenario.freeze:
        for name, param in model.named_parameters():
            if name.startswith("position_embedding") or name.startswith("blocks.0.ln_attn"):
                param.requires_grad_(False)
    return model, units


def micro_batch(scenario: Scenario, step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    rows = ROWS_PER_RANK * world_size
    if scenario.model == "encoder":
        inputs = torch.randn(rows, 8, 32, generator=generator)
        return inputs, torch.randn(rows, 8, 32, generator=generator)
    tokens = torch.randint(0, 256, (rows, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(scenario: Scenario, model: nn.Module, inputs, targets) -> torch.Tensor:
    if scenario.model == "encoder":
        return nn.functional.mse_loss(model(inputs), targets)
    return model(inputs, targets)


def optimizer_for(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def train_reference(scenario: Scenario, world_size: int) -> list[float]:
    model, _ = build_model(scenario)
    optimizer = optimizer_for([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(scenario.accumulation):
            inputs, targets = micro_batch(scenario, step, micro, world_size)
            loss = loss_of(scenario, model, inputs, targets) / scenario.accumulation
            loss.backward()
            total += loss.item()
        if scenario.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), scenario.clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def train_sharded(scenario: Scenario, rank: int, world_size: int, topology: Topology) -> list[float]:
    model, units = build_model(scenario)
    config = ZeroConfig(
        activation_checkpointing=scenario.checkpointing,
        hpz_size=topology.ranks_per_node if scenario.hpz else 1,
    )
    sharded = ShardedModel(model, topology, config, unit_classes=units)
    optimizer = ShardedOptimizer(sharded, optimizer_for)
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(scenario.accumulation):
            inputs, targets = micro_batch(scenario, step, micro, world_size)
            loss = loss_of(scenario, sharded, inputs[rows], targets[rows]) / scenario.accumulation
            loss.backward()
            total += loss.detach()
        if scenario.clip is not None:
            optimizer.clip_grad_norm_(scenario.clip)
        optimizer.step()
        optimizer.zero_grad()
        torch.distributed.all_reduce(total)  # the global-batch loss is the mean over ranks
        losses.append(total.item() / world_size)
    return losses


def train_step(model, optimizer, inputs, targets) -> float:
    """One forward, backward and optimizer step on this rank's rows; the global batch's
    loss (the mean over ranks, every rank holding as many rows)."""
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()
