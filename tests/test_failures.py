"""Failures end cleanly: a crashed or hung rank, divergent collectives, non-finite
gradients and a model changed after wrapping each give an error that says what happened."""

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.collectives.failures import CollectiveError, CollectiveOrderError
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

TIMEOUT_S = 5.0


def lose_a_rank(rank, world_size, mode, folder):
    topology = Topology.from_environment(ranks_per_node=1, timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, ZeroConfig(), unit_classes=(Block,))
    tokens = torch.randint(0, 256, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    reported = [Path(folder, f"reported{peer}") for peer in range(2)]
    if rank == 2:
        if mode == "crash":
            os._exit(0)
        # Hung past the timeout, then gone: once both peers have named it (sooner than a fixed
        # sleep long enough for a loaded machine), or after TIMEOUT_S + 8 s at the latest.
        deadline = time.monotonic() + TIMEOUT_S + 8
        while time.monotonic() < deadline and not all(path.exists() for path in reported):
            time.sleep(0.1)
        os._exit(0)
    started = time.monotonic()
    try:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    except CollectiveError as error:
        waited = time.monotonic() - started
        reported[rank].touch()
        return str(error), waited
    return None, time.monotonic() - started


@pytest.mark.parametrize("mode", ["crash", "hang"])
def test_lost_rank_is_named_within_the_timeout(mode, tmp_path):
    started = time.monotonic()
    results = spawn_ranks(lose_a_rank, 3, (mode, str(tmp_path)), timeout_s=60, collective_timeout_s=TIMEOUT_S)
    for message, waited in results[:2]:
        assert message is not None
        assert "(crashed or hung): [2]" in message, message
        assert "all_gather" in message and "forward_gather" in message
        assert waited < TIMEOUT_S + 5, waited
    assert results[2] is None
    assert time.monotonic() - started < 45


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x, skip_first: bool):
        if not skip_first:  # data-dependent control flow, different on each rank
            x = self.first(x)
        return self.second(x)


def diverge(rank, world_size):
    topology = Topology.from_environment(ranks_per_node=1)
    model = ShardedModel(Branchy(), topology, ZeroConfig(debug_collective_order=True), unit_classes=(nn.Linear,))
    try:
        model(torch.ones(2, 8), skip_first=rank == 1)
    except CollectiveOrderError as error:
        return str(error)
    return None


def test_debug_mode_reports_divergent_collectives():
    for message in spawn_ranks(diverge, 2):
        assert message is not None
        assert "member 0: all_gather" in message and "unit first:True" in message
        assert "member 1: all_gather" in message and "unit second:True" in message


def test_debug_mode_fingerprints_live_on_the_collectives_device():
    # NCCL gathers CUDA tensors only: the fingerprints go where the collective's tensor is.
    # The meta device stands in for the GPU on a fake process group.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zeropp.collectives.failures import CollectiveCall, gather_fingerprints

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        call = CollectiveCall("all_gather", "world", "forward", "unit 0", 8, "float32")
        fingerprint, everyone = gather_fingerprints(call, None, 4, torch.device("meta"))
    finally:
        dist.destroy_process_group()
    assert fingerprint.device.type == everyone.device.type == "meta" and everyone.shape == (4,)


def nonfinite(rank, world_size, policy):
    topology = Topology.from_environment(ranks_per_node=1)
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, ZeroConfig(), unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda p: torch.optim.AdamW(p, lr=1e-3), on_nonfinite=policy)
    tokens = torch.randint(0, 256, (2, 17))
    before = model.full_state_dict()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    if rank == 1:
        loss = loss * float("nan")
    loss.backward()
    try:
        stepped = optimizer.step()
    except FloatingPointError as error:
        return str(error)
    after = model.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return stepped, optimizer.skipped_steps, unchanged


def test_nonfinite_gradients_skip_the_step_everywhere():
    for stepped, skipped, unchanged in spawn_ranks(nonfinite, 2, ("skip",)):
        assert stepped is False and skipped == 1 and unchanged


def test_nonfinite_gradients_can_stop_training():
    for message in spawn_ranks(nonfinite, 2, ("raise",)):
        assert "non-finite gradients, by rank and unit: {1: [" in message and "blocks.1:True" in message


def replaced_parameter(rank, world_size):
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), Topology.from_environment(1), ZeroConfig(), (Block,))
    model.module.ln_final.weight = nn.Parameter(torch.ones(3))
    model(torch.zeros(1, 4, dtype=torch.long))


def test_parameter_replaced_after_wrapping_is_named():
    with pytest.raises(ValueError, match=r"ln_final.weight was replaced after wrapping \(now shape \(3,\)"):
        spawn_ranks(replaced_parameter, 1)


def _environment_variable(rank, world_size, name):
    return os.environ.get(name)


def test_ranks_see_the_callers_environment_not_the_fork_servers(monkeypatch):
    spawn_ranks(_environment_variable, 2, ("ZEROPP_TEST_VARIABLE",))  # the fork server is running now
    monkeypatch.setenv("ZEROPP_TEST_VARIABLE", "set after the server started")
    assert spawn_ranks(_environment_variable, 2, ("ZEROPP_TEST_VARIABLE",)) == ["set after the server started"] * 2
