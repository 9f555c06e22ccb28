"""The engine's accelerator path dry-run on the meta device as one rank of a fake world."""

import pytest
import torch
import torch.distributed as dist

from zeropp.collectives.primitives import PendingReduceScatter
from zeropp_tools.dryrun import DryRun, dry_run, join_fake_world

SMALL = dict(layers=2, hidden=256, vocabulary=1000, nodes=2, ranks_per_node=4, tokens_per_rank=64)


@pytest.fixture
def fake_world():
    yield lambda run: join_fake_world(run)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("variant", ["zero3", "zero++"])
def test_a_training_step_runs_without_host_syncs_and_matches_the_memory_model(fake_world, variant):
    run = DryRun(**SMALL, variant=variant)
    fake_world(run)
    result = dry_run(run)
    assert result["host_syncs"] == {}
    # Between steps the holdings are the model's exactly (masters, compute-dtype shards,
    # Adam's moments, gradient shards, kept copies); the phase peaks are held to the model
    # on real CPU ranks in test_memory_model.py.
    for phase in ("resting", "optimizer_step"):
        measured, predicted = result["measured_bytes"][phase], result["predicted_bytes"][phase]
        assert abs(measured - predicted) <= 0.05 * measured, (phase, measured, predicted)
    assert result["comm_bytes"]["forward_gather"]["received"] > 0


def test_a_tensor_created_without_a_device_is_caught(fake_world, monkeypatch):
    original = PendingReduceScatter.wait

    def careless_wait(self):  # a CPU tensor where the device's belongs
        return original(self) + torch.zeros(1)

    monkeypatch.setattr(PendingReduceScatter, "wait", careless_wait)
    run = DryRun(**SMALL, variant="zero3")
    fake_world(run)
    with pytest.raises(RuntimeError, match="meta"):
        dry_run(run, steps=1)


def test_a_host_sync_in_the_hot_path_is_counted_and_named(fake_world, monkeypatch):
    original = PendingReduceScatter.wait

    def syncing_wait(self):
        shard = original(self)
        shard.abs().max().item()  # e.g. a per-unit overflow check
        return shard

    monkeypatch.setattr(PendingReduceScatter, "wait", syncing_wait)
    run = DryRun(**SMALL, variant="zero3")
    fake_world(run)
    syncs = dry_run(run, steps=1)["host_syncs"]
    assert sum(syncs.values()) == 3  # one per unit: two blocks and the root
    assert all("item" in where and "backward" in where for where in syncs)
