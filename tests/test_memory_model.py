"""The memory model against live tensor bytes counted at the dispatcher, phase by phase."""

import pytest
import torch

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.memory_tracker import LiveTensorTracker
from zeropp.models import GPT, Block, GPTConfig

MODEL = GPTConfig(num_layers=4, num_heads=4, embed_dim=256, block_size=8)
TOLERANCE = 0.10

CONFIGS = {
    "zero3": dict(),
    "zero++": dict(quantized_weights=True, hpz_size=2, quantized_gradients=True),
    "hpz": dict(hpz_size=2),
    "deltas": dict(weight_deltas=True),
    "mixz++": dict(quantized_nontrainable_weights=True, hpz_size=2),
}


def measure_all(rank, world_size):
    """Every configuration in the same four processes (one start-up for all)."""
    topology = Topology.from_environment(ranks_per_node=2)
    return {name: measure_phases(topology, rank, name) for name in CONFIGS}


def measure_phases(topology, rank, name):
    torch.manual_seed(0)
    tracker = LiveTensorTracker()
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(rank))
    with tracker:
        module = GPT(MODEL)
        if name == "mixz++":  # a frozen base: the attention weights of every block
            for block in module.blocks:
                block.attn.requires_grad_(False)
        model = ShardedModel(module, topology, ZeroConfig(**CONFIGS[name]), unit_classes=(Block,))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(2):  # measure the second step: caches and copies exist, and old gradients
            tracker.reset_peaks()
            tracker.training_step(lambda: model(tokens[:, :-1], tokens[:, 1:]), optimizer)
        measured = {phase: tracker.phase_peak_total(phase) for phase in ("forward", "backward", "optimizer_step")}
        measured["resting"] = tracker.current_total()
        tracker.reset_peaks()
        tracker.mark_phase("generation")
        with torch.no_grad(), model.generation_mode():
            model(tokens[:, :-1])
        measured["generation"] = tracker.phase_peak_total("generation")
    return measured, model.predicted_memory()


@pytest.fixture(scope="module")
def measurements():
    return spawn_ranks(measure_all, 4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_predicted_memory_matches_live_tensor_bytes(measurements, name):
    for rank_results in measurements:
        measured, predicted = rank_results[name]
        for phase, value in measured.items():
            expected = predicted[phase]["total"]
            assert abs(value - expected) <= TOLERANCE * value, (name, phase, value, predicted[phase])
