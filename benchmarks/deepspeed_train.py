"""DeepSpeed ZeRO-3 / ZeRO++ training of the example GPT under torchrun, for side-by-side throughput.

    torchrun --nnodes 2 --nproc-per-node 2 ... benchmarks/deepspeed_train.py --variant zero++ --out DIR

Runs with the separate environment from ``make deepspeed-setup`` (DeepSpeed is not a zeropp
dependency) and ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` = ranks per node (DeepSpeed's CPU
accelerator reads its node size from it; qgZ needs it to see more than one node). DeepSpeed's
quantizer op is CUDA-only, so ZeRO++ uses the stand-in in ``deepspeed_quantizer.py``; the
summary counts its calls, which shows qwZ and qgZ really ran. Same model, data, optimizer,
precision and step timing as ``zeropp train`` (peer_training.py).
"""

from __future__ import annotations

import logging
import os

import deepspeed
import torch

from deepspeed_quantizer import install as install_quantizer
from peer_training import Batch, parse_arguments, train_and_report
from zeropp.memory import resident_bytes
from zeropp.models import GPT, GPTConfig

VARIANTS = ("zero3", "zero++", "zero3-small-buckets", "zero++-small-buckets")
# DeepSpeed's default reduce bucket (5e8 elements) holds every gradient of these models, so
# the reduce-scatter starts after backward; a bucket of about one block lets it run during
# backward. The gather side needs no tuning: the default prefetch bucket (5e7) covers the model.
SMALL_REDUCE_BUCKET = 1_000_000


def ds_config(variant: str, batch_per_rank: int, accumulation: int, precision: str, ranks_per_node: int) -> dict:
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    if variant.endswith("-small-buckets"):
        zero["reduce_bucket_size"] = SMALL_REDUCE_BUCKET
    if variant.startswith("zero++"):
        zero.update(zero_quantized_weights=True, zero_hpz_partition_size=ranks_per_node,
                    zero_quantized_gradients=True)
    return {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }


def main() -> None:
    baseline_bytes = resident_bytes()
    args = parse_arguments(VARIANTS)
    torch.set_num_threads(1)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    quantizer = install_quantizer()
    per_node = int(os.environ.get("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"]))
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = ds_config(args.variant, args.batch_per_rank, args.accumulation, args.precision, per_node)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def train_step(micro_batches: list[Batch]) -> torch.Tensor:
        # DeepSpeed's accumulation: engine.backward scales each loss by 1/accumulation and
        # reduces in every micro-step (ZeRO-3 has no no_sync); engine.step steps the
        # optimizer at the boundary only.
        total = torch.zeros(())
        for inputs, targets in micro_batches:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / len(micro_batches)
        return total

    train_and_report(args, train_step, baseline_bytes, lambda: {"stand_in_quantizer_calls": quantizer.calls})


if __name__ == "__main__":
    main()
