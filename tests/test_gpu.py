"""The CUDA path (``make gpu-check``; every test here is skipped without a CUDA device).

NCCL with one rank; gloo moving CUDA tensors between 4 ranks that share one GPU as 2 nodes
x 2 ranks; loss parity on CUDA against plain PyTorch; checkpoints and DCP from CUDA
tensors; quantization throughput against a device memcpy, recorded with the machine.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from parity import train_step

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.checkpoint import DistributedState, load_checkpoint, save_checkpoint
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.quantization.blocks import BlockFormat, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
STEPS = 4
RESULTS = Path(os.environ.get("ZEROPP_GPU_RESULTS", "benchmarks/results/gpu"))


def batch(step, device, rows=slice(None)):
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))[rows]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def reference_losses():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, "cuda"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_sharded(rank, world_size, options, device, folder):
    topology = Topology.from_environment(ranks_per_node=min(2, world_size), device=device)
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")).to(topology.device), topology, ZeroConfig(**options),
                         unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    per = 4 // world_size
    losses = []
    for step in range(STEPS):
        losses.append(train_step(model, optimizer, *batch(step, topology.device, slice(rank * per, (rank + 1) * per))))
    assert all(flat.master.device == topology.device for flat in model.flat_params())
    save_checkpoint(model, optimizer, folder, step=STEPS)
    before = model.full_state_dict()
    load_checkpoint(model, optimizer, folder)
    # Every shard is placed on the device its rank reported (4 ranks share cuda:0 here;
    # a placement derived from the layout named cuda:1, which made dcp.save fail).
    for value in model.state_dict().values():
        for shard in getattr(value, "local_shards", lambda: [])():
            assert shard.metadata.placement.device() == topology.device, shard.metadata.placement
    dcp.save({"train": DistributedState(model, optimizer)}, checkpoint_id=f"{folder}/dcp")
    dcp.load({"train": DistributedState(model, optimizer)}, checkpoint_id=f"{folder}/dcp")
    after = model.full_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    return losses


def test_nccl_one_rank_matches_plain_pytorch_on_cuda(tmp_path):
    expected = reference_losses()
    losses = spawn_ranks(train_sharded, 1, ({}, None, str(tmp_path)), backend="cpu:gloo,cuda:nccl")[0]
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(losses, expected)), (losses, expected)


@pytest.mark.parametrize("options,tolerance", [({}, 1e-5),
                                               (dict(quantized_weights=True, hpz_size=2, quantized_gradients=True), 2e-2)])
def test_gloo_moves_cuda_tensors_for_four_ranks_on_one_gpu(tmp_path, options, tolerance):
    expected = reference_losses()
    for losses in spawn_ranks(train_sharded, 4, (options, "cuda:0", str(tmp_path))):
        assert all(abs(g - w) <= tolerance * w for g, w in zip(losses, expected)), (losses, expected)


def _time(fn, repeats=20) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def test_quantization_throughput_against_device_memcpy():
    values = torch.randn(64 * 2**20, device="cuda")
    copy_target = torch.empty_like(values)
    memcpy = _time(lambda: copy_target.copy_(values))
    rows = {}
    for bits in (8, 4):
        seconds = _time(lambda: quantize(values, BlockFormat(bits=bits)))
        rows[f"int{bits}"] = {"seconds": seconds, "fraction_of_memcpy": memcpy / seconds}
    record = {"memcpy_seconds": memcpy, "numel": values.numel(), "quantize": rows,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quantization.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    assert all(row["fraction_of_memcpy"] > 0.05 for row in rows.values()), rows  # a kernel, not a host loop
