"""PyTorch FSDP2 training of the example GPT under torchrun, for side-by-side throughput.

    torchrun --nnodes 2 --nproc-per-node 2 ... benchmarks/fsdp2_train.py --variant hsdp --out DIR

Variants: ``plain`` (fully_shard over the world, reshard after forward), ``reshard-node``
(reshard_after_forward = ranks per node: FSDP2's analogue of hpZ), ``hsdp`` (2-D mesh:
shard inside the node, replicate across nodes), and ``plain-prefetch`` / ``hsdp-prefetch``:
the same with explicit prefetching, each block gathering the next one in forward and the
previous one in backward. FSDP2 overlaps through CUDA streams; on CPU there are none, so
only explicit prefetching lets a gather run under compute. ``hsdp-kept``: HSDP whose
accumulation keeps the unsharded weights between micro-steps (``set_reshard_after_forward``
and ``set_reshard_after_backward`` False until the last), as torchtitan does. Same model, data, optimizer, precision and
step timing as ``zeropp train`` (peer_training.py); rank 0 writes ``summary.json``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from peer_training import Batch, parse_arguments, train_and_report
from zeropp.config import parse_dtype
from zeropp.memory import resident_bytes
from zeropp.models import GPT, GPTConfig

VARIANTS = ("plain", "reshard-node", "hsdp", "plain-prefetch", "hsdp-prefetch", "hsdp-kept")


def shard(model: GPT, variant: str, world_size: int, per_node: int, dtype: torch.dtype) -> None:
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if variant.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    reshard = per_node if variant == "reshard-node" else True
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if variant.endswith("-prefetch"):
        blocks = list(model.blocks)
        for index, block in enumerate(blocks):
            if index + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[index + 1]])
            if index > 0:
                block.set_modules_to_backward_prefetch([blocks[index - 1]])


def main() -> None:
    baseline_bytes = resident_bytes()
    args = parse_arguments(VARIANTS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model))
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    shard(model, args.variant, dist.get_world_size(), per_node, parse_dtype("precision", args.precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def train_step(micro_batches: list[Batch]) -> torch.Tensor:
        # FSDP2's accumulation: no reduction until the last micro-batch (each rank keeps
        # its unsharded gradients meanwhile), then one reduce-scatter (and, in HSDP, one
        # all-reduce across nodes) of the sum.
        total = torch.zeros(())
        for index, (inputs, targets) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            if args.variant.endswith("-kept"):
                model.set_reshard_after_forward(last)
                model.set_reshard_after_backward(last)
            loss = model(inputs, targets) / len(micro_batches)
            loss.backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return total

    train_and_report(args, train_step, baseline_bytes)


if __name__ == "__main__":
    main()
