"""What the peer-system scripts (fsdp2_train.py, deepspeed_train.py) share: the command line,
the timed loop over the example GPT's data, and rank 0's summary. Each script supplies only
how its system wraps the model and takes one step, so the work compared is the same."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp.data import ByteCorpus, load_stdlib_corpus

WARMUP_STEPS = 5  # as `zeropp train`'s summary


def parse_arguments(variants: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=variants, default=variants[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def train_and_report(args: argparse.Namespace, train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     extra: Callable[[], dict] = dict) -> None:
    """Run ``train_step(inputs, targets) -> loss`` for ``args.steps`` steps on this rank's
    batches; rank 0 writes ``summary.json`` (median step time after warm-up, losses, and
    whatever ``extra()`` returns), then the world is torn down."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = ByteCorpus(load_stdlib_corpus())
    step_times, losses = [], []
    for step in range(args.steps):
        inputs, targets = corpus.rank_batch("train", step, args.batch_per_rank, args.seq_len, rank, world_size)
        started = time.perf_counter()
        total = train_step(inputs, targets).detach().float()
        dist.all_reduce(total)
        step_times.append(time.perf_counter() - started)
        losses.append(total.item() / world_size)
    median = statistics.median(step_times[WARMUP_STEPS:])
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps({
            "variant": args.variant, "median_step_s": median,
            "tokens_per_s": world_size * args.batch_per_rank * args.seq_len / median, "losses": losses, **extra(),
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()
