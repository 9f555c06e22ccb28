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
from zeropp.memory import peak_resident_bytes


def parse_arguments(variants: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=variants, default=variants[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--untimed-steps", type=int, default=5, help="first steps left out of the median (as zeropp train)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--out", required=True)
    return parser.parse_args()


Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), each [batch_per_rank, seq_len]


def train_and_report(args: argparse.Namespace, train_step: Callable[[list[Batch]], torch.Tensor],
                     baseline_bytes: int, extra: Callable[[], dict] = dict) -> None:
    """Run ``train_step(micro_batches) -> mean loss`` (one optimizer step over
    ``args.accumulation`` micro-batches) for ``args.steps`` steps on this rank's batches, the
    micro-batches ``zeropp train`` reads; rank 0 writes ``summary.json`` (median step time
    after the untimed steps, losses, each rank's peak resident set above ``baseline_bytes``
    (what it held before building the model, as ``zeropp train`` counts it) and whatever
    ``extra()`` returns), then the world is torn down."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = ByteCorpus(load_stdlib_corpus())
    step_times, losses = [], []
    for step in range(args.steps):
        micro_batches = [corpus.rank_batch("train", step * args.accumulation + micro, args.batch_per_rank,
                                           args.seq_len, rank, world_size) for micro in range(args.accumulation)]
        started = time.perf_counter()
        total = train_step(micro_batches).detach().float()
        dist.all_reduce(total)
        step_times.append(time.perf_counter() - started)
        losses.append(total.item() / world_size)
    median = statistics.median(step_times[min(args.untimed_steps, len(step_times) - 1):])
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_resident_bytes() - baseline_bytes)
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps({
            "variant": args.variant, "median_step_s": median,
            "accumulation": args.accumulation,
            "tokens_per_s": world_size * args.batch_per_rank * args.seq_len * args.accumulation / median, "losses": losses,
            "peak_rss_increase_bytes_by_rank": peaks, **extra(),
        }, indent=2))
    dist.barrier()
    dist.destroy_process_group()
