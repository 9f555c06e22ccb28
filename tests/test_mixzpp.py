"""MixZ++ (quantized_nontrainable_weights): frozen weights gathered INT8 and, with hpZ,
kept inside the node after their first gather, in fp32, bf16 and fp16 compute."""

import pytest
import torch

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.deepspeed_config import load_deepspeed_config
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

STEPS = 4


def build(frozen: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    frozen_part = model if frozen == "all" else model.blocks  # a reference model, or a LoRA-style base
    for param in frozen_part.parameters():
        param.requires_grad_(False)
    return model


def batch(rank):
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    return tokens[:, :-1], tokens[:, 1:]


def crossing(model) -> int:
    return model.comm_log.totals().get("received_inter_node", 0)


def train_with_frozen_blocks(rank, world_size, dtype):
    config = ZeroConfig(compute_dtype=dtype, hpz_size=2, quantized_nontrainable_weights=True)
    model = ShardedModel(build("blocks"), Topology.from_environment(ranks_per_node=2), config, unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    measured, predicted = [], []
    for _ in range(STEPS):
        model.comm_log.reset()
        optimizer.scale_loss(model(*batch(rank))).backward()
        optimizer.step()
        optimizer.zero_grad()
        rows = model.comm_log.totals_by_phase()
        measured.append({phase: rows[phase]["received_inter_node"] for phase in ("forward_gather", "backward_gather")})
        predicted.append({phase: model.predicted_step_bytes()[phase]["received_inter_node"]
                          for phase in ("forward_gather", "backward_gather")})
    return measured, predicted


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_frozen_base_crosses_nodes_once_then_matches_the_prediction(dtype):
    for rank, (measured, predicted) in enumerate(spawn_ranks(train_with_frozen_blocks, 4, (dtype,))):
        assert measured[1] == measured[2] == measured[3] == predicted[3], (rank, measured, predicted)
        if rank % 2 == 0:  # ranks that receive from the other node in the ring
            assert measured[0]["forward_gather"] > measured[1]["forward_gather"]  # the blocks' first gather


def serve_frozen_model(rank, world_size, mixzpp):
    config = ZeroConfig(hpz_size=2, quantized_nontrainable_weights=mixzpp)
    model = ShardedModel(build("all"), Topology.from_environment(ranks_per_node=2), config, unit_classes=(Block,))
    inputs, _ = batch(0)
    crossings, logits = [], None
    with torch.no_grad():
        for _ in range(3):  # a reference model scoring rollouts, call after call
            model.comm_log.reset()
            logits = model(inputs)
            crossings.append(crossing(model))
    return crossings, logits


def test_a_frozen_model_never_crosses_nodes_after_its_first_gather():
    reference = build("all")
    with torch.no_grad():
        expected = reference(batch(0)[0])
    for rank, ((crossings, logits), (plain, exact)) in enumerate(zip(spawn_ranks(serve_frozen_model, 4, (True,)),
                                                                    spawn_ranks(serve_frozen_model, 4, (False,)))):
        assert crossings[1] == crossings[2] == 0
        assert torch.equal(exact, expected)  # hpZ alone: exact weights
        assert (logits - expected).norm() <= 0.02 * expected.norm()  # INT8 weights
        if rank % 2 == 0:
            assert 0 < crossings[0] < plain[0]  # the first gather: INT8 codes instead of fp32


def test_the_deepspeed_key_turns_it_on():
    config, _ = load_deepspeed_config({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    assert config.quantized_nontrainable_weights
