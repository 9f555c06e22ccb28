"""Sharded checkpoints: exact resume, re-sharding to other layouts, crash safety, clear
errors for bad checkpoints, and a consolidated export that plain PyTorch loads."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from parity import train_step
from safetensors.torch import load_file

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.checkpoint import CheckpointError, export_consolidated, load_checkpoint, resolve_checkpoint, save_checkpoint
from zeropp.checkpoint.sharded import write_shards
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

GLOBAL_ROWS = 12  # divisible by 2, 3 and 4 ranks


def build(topology, seed=0, size="tiny", config=None):
    torch.manual_seed(seed)
    model = ShardedModel(GPT(GPTConfig.preset(size)), topology, config or ZeroConfig(), unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1))
    return model, optimizer


def train(model, optimizer, steps, rank, world_size):
    losses = []
    rows = GLOBAL_ROWS // world_size
    for step in steps:
        tokens = torch.randint(0, 256, (GLOBAL_ROWS, 33), generator=torch.Generator().manual_seed(step))
        mine = tokens[rank * rows : (rank + 1) * rows]
        losses.append(train_step(model, optimizer, mine[:, :-1], mine[:, 1:]))
    return losses


def resume_run(rank, world_size, root):
    topology = Topology.from_environment(ranks_per_node=2)
    model, optimizer = build(topology)
    uninterrupted = train(model, optimizer, range(6), rank, world_size)
    model, optimizer = build(topology)
    first = train(model, optimizer, range(3), rank, world_size)
    save_checkpoint(model, optimizer, root, step=3, extra={"data_step": 3})
    model, optimizer = build(topology, seed=123)  # different weights, to be overwritten
    info = load_checkpoint(model, optimizer, root)
    second = train(model, optimizer, range(info.extra["data_step"], 6), rank, world_size)
    return uninterrupted, first + second, info.step


def test_resume_gives_identical_losses(tmp_path):
    uninterrupted, resumed, step = spawn_ranks(resume_run, 4, (str(tmp_path),))[0]
    assert step == 3
    assert resumed == uninterrupted  # fp32: bit for bit


def save_reference(rank, world_size, root):
    topology = Topology.from_environment(ranks_per_node=2)
    model, optimizer = build(topology)
    train(model, optimizer, range(3), rank, world_size)
    save_checkpoint(model, optimizer, root, step=3)
    state = model.full_state_dict()
    continued = train(model, optimizer, range(3, 6), rank, world_size)
    return state, continued


def load_other_layout(rank, world_size, root, ranks_per_node, config_kwargs):
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    model, optimizer = build(topology, seed=7, config=ZeroConfig(**config_kwargs))
    load_checkpoint(model, optimizer, root)
    state = model.full_state_dict()
    return state, train(model, optimizer, range(3, 6), rank, world_size)


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    state, continued = spawn_ranks(save_reference, 4, (str(root),))[0]
    return root, state, continued


@pytest.mark.parametrize(
    "world_size,ranks_per_node,config_kwargs",
    [(2, 2, {}), (3, 3, {}), (4, 1, {}), (4, 2, {"quantized_gradients": True, "quantization_block_size": 64})],
)
def test_reshard_on_load(saved_2x2, world_size, ranks_per_node, config_kwargs):
    root, state, continued = saved_2x2
    loaded, losses = spawn_ranks(load_other_layout, world_size, (str(root), ranks_per_node, config_kwargs))[0]
    assert loaded.keys() == state.keys()
    for name in state:
        assert torch.equal(loaded[name], state[name]), name
    if not config_kwargs:  # same numerics, other layout: only summation order differs
        for a, b in zip(losses, continued):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, continued)


def test_export_loads_into_plain_pytorch(saved_2x2, tmp_path):
    root, state, _ = saved_2x2
    output = export_consolidated(root, tmp_path / "model.safetensors")
    model = GPT(GPTConfig.preset("tiny"))
    model.load_state_dict(load_file(str(output)), strict=True)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), state[name]), name


def stop_before_commit(rank, world_size, root):
    topology = Topology.from_environment(ranks_per_node=1)
    model, optimizer = build(topology)
    train(model, optimizer, range(2), rank, world_size)
    save_checkpoint(model, optimizer, root, step=2)
    state = model.full_state_dict()
    train(model, optimizer, range(2, 4), rank, world_size)
    write_shards(model, optimizer, root, step=4, extra=None)  # the save "dies" before commit
    model, optimizer = build(topology, seed=9)
    info = load_checkpoint(model, optimizer, root)
    return info.step, state, model.full_state_dict()


def test_unfinished_save_is_ignored(tmp_path):
    step, saved, loaded = spawn_ranks(stop_before_commit, 2, (str(tmp_path),))[0]
    assert step == 2 and any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    for name in saved:
        assert torch.equal(saved[name], loaded[name])


SAVE_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
    from zeropp.checkpoint import save_checkpoint
    from zeropp.launch import spawn_ranks
    from zeropp.models import GPT, Block, GPTConfig

    def run(rank, world_size, root):
        model = ShardedModel(GPT(GPTConfig.preset("medium")), Topology.from_environment(1), ZeroConfig(), (Block,))
        optimizer = ShardedOptimizer(model, lambda p: torch.optim.AdamW(p))
        for step in range(1000):
            save_checkpoint(model, optimizer, root, step=step)

    if __name__ == "__main__":
        spawn_ranks(run, 1, (sys.argv[1],))
    """
)


def test_save_killed_mid_write_leaves_a_loadable_checkpoint(tmp_path):
    script = tmp_path / "save_forever.py"
    script.write_text(SAVE_FOREVER)
    root = tmp_path / "ckpt"
    process = subprocess.Popen([sys.executable, str(script), str(root)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (root / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.7)  # somewhere inside a later save
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    folder = resolve_checkpoint(root)
    metadata = json.loads((folder / "metadata.json").read_text())
    from zeropp.checkpoint.format import verify_file

    for name in metadata["files"]:
        verify_file(folder, name, metadata)  # every byte is as recorded


def test_truncated_corrupted_and_incompatible_checkpoints_fail_clearly(saved_2x2, tmp_path):
    import shutil

    root, _, _ = saved_2x2
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    folder = resolve_checkpoint(copy)
    victim = folder / "rank00001.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="rank00001.safetensors has .* bytes"):
        spawn_ranks(load_other_layout, 2, (str(copy), 2, {}))
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="sha256"):
        spawn_ranks(load_other_layout, 2, (str(copy), 2, {}))


def load_into_small(rank, world_size, root):
    topology = Topology.from_environment(ranks_per_node=1)
    model, optimizer = build(topology, size="small")
    load_checkpoint(model, optimizer, root)


def test_checkpoint_from_another_model_is_rejected(saved_2x2):
    root, _, _ = saved_2x2
    with pytest.raises(CheckpointError, match="shape differs"):
        spawn_ranks(load_into_small, 1, (str(root),))


def save_medium(rank, world_size, root):
    model, optimizer = build(Topology.from_environment(ranks_per_node=2), size="medium")
    save_checkpoint(model, optimizer, root, step=0)


def test_export_streams_below_twice_the_model_size(tmp_path):
    spawn_ranks(save_medium, 4, (str(tmp_path / "ckpt"),))
    snippet = (
        "import json, sys; from zeropp_tools.cli.main import measure_export; "
        "print(json.dumps(measure_export(sys.argv[1], sys.argv[2])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", snippet, str(tmp_path / "ckpt"), str(tmp_path / "medium.safetensors")],
        capture_output=True, text=True, check=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model_bytes"] > 40e6  # the medium GPT, about 10.7M fp32 parameters
    assert report["peak_rss_increase_bytes"] < 2 * report["model_bytes"], report


def train_job(rank, world_size, config):
    from zeropp.train import train as run_training

    return run_training(rank, world_size, config)["losses"]


def test_training_job_resumes_after_a_crash(tmp_path):
    from dataclasses import replace

    from zeropp.train import TrainConfig

    config = TrainConfig(
        model_size="tiny", steps=6, batch_per_rank=2, seq_len=32, eval_every=6, ranks_per_node=2,
        checkpoint_dir=str(tmp_path), checkpoint_every=3,
    )
    uninterrupted = spawn_ranks(train_job, 4, (config,))[0]
    (tmp_path / "latest").write_text("step_00000003\n")  # as if the job died during step 4
    resumed = spawn_ranks(train_job, 4, (replace(config, resume=True),))[0]
    assert resumed == uninterrupted[3:]
