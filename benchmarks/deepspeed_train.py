"""DeepSpeed ZeRO-3 / ZeRO++ training of the example GPT under torchrun, for side-by-side throughput.

    torchrun --nnodes 2 --nproc-per-node 2 ... benchmarks/deepspeed_train.py --variant zero++ --out DIR

Runs with the separate environment from ``make deepspeed-setup`` (DeepSpeed is not a zeropp
dependency) and ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` = ranks per node (DeepSpeed's CPU
accelerator reads its node size from it; qgZ needs it to see more than one node). DeepSpeed's
quantizer op is CUDA-only, so ZeRO++ uses the stand-in in ``deepspeed_quantizer.py``.
Same model, data, optimizer, precision and step timing as ``zeropp train``; rank 0 writes
``summary.json`` with the median step time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from deepspeed_quantizer import install as install_quantizer
from zeropp.data import ByteCorpus, load_stdlib_corpus
from zeropp.models import GPT, GPTConfig

VARIANTS = ("zero3", "zero++")


def ds_config(variant: str, batch_per_rank: int, precision: str, ranks_per_node: int) -> dict:
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    if variant == "zero++":
        zero.update(zero_quantized_weights=True, zero_hpz_partition_size=ranks_per_node,
                    zero_quantized_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, default="zero3")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    quantizer = install_quantizer()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"]))
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(args.variant, args.batch_per_rank, args.precision, per_node))
    corpus = ByteCorpus(load_stdlib_corpus())
    step_times, losses = [], []
    for step in range(args.steps):
        inputs, targets = corpus.rank_batch("train", step, args.batch_per_rank, args.seq_len, rank, world_size)
        started = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
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
            "stand_in_quantizer_calls": quantizer.calls,
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
