"""PyTorch FSDP2 training of the example GPT under torchrun, for side-by-side throughput.

    torchrun --nnodes 2 --nproc-per-node 2 ... benchmarks/fsdp2_train.py --variant hsdp --out DIR

Variants: ``plain`` (fully_shard over the world, reshard after forward), ``reshard-node``
(reshard_after_forward = ranks per node: FSDP2's analogue of hpZ), ``hsdp`` (2-D mesh:
shard inside the node, replicate across nodes). Same model, data, optimizer, precision and
step timing as ``zeropp train``; rank 0 writes ``summary.json`` with the median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zeropp.config import parse_dtype
from zeropp.data import ByteCorpus, load_stdlib_corpus
from zeropp.models import GPT, GPTConfig

VARIANTS = ("plain", "reshard-node", "hsdp")


def shard(model: GPT, variant: str, world_size: int, per_node: int, dtype: torch.dtype) -> None:
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    if variant == "hsdp":
        mesh = init_device_mesh("cpu", (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    reshard = per_node if variant == "reshard-node" else True
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, default="plain")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model))
    shard(model, args.variant, world_size, per_node, parse_dtype("precision", args.precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    corpus = ByteCorpus(load_stdlib_corpus())
    step_times, losses = [], []
    for step in range(args.steps):
        inputs, targets = corpus.rank_batch("train", step, args.batch_per_rank, args.seq_len, rank, world_size)
        started = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float()
        dist.all_reduce(total)
        step_times.append(time.perf_counter() - started)
        losses.append(total.item() / world_size)
    median = statistics.median(step_times[5:])
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps({
            "variant": args.variant, "median_step_s": median,
            "tokens_per_s": world_size * args.batch_per_rank * args.seq_len / median, "losses": losses,
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
