"""TRL's SFTTrainer on zeropp: supervised fine-tuning of a tiny Llama-style model on the
lines of a local text file, with a byte-level tokenizer trained on it (nothing
downloaded). On 4 processes acting as 2 nodes x 2::

    torchrun --nproc-per-node 4 examples/trl_sft.py --ranks-per-node 2            # ZeRO-3, exact
    torchrun --nproc-per-node 4 examples/trl_sft.py --ranks-per-node 2 --zero++   # qwZ + hpZ + qgZ
    torchrun --nproc-per-node 4 examples/trl_sft.py --ddp                         # TRL on accelerate's DDP

Each rank writes its loss per optimizer step to ``OUT/losses_rank{R}.json``.
"""

import argparse
import os
from pathlib import Path

import datasets
import torch
from trl import SFTConfig, SFTTrainer

from hf_trainer import DEFAULT_DATA, recording, tiny_llama, write_losses
from make_hf_model import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help="TRL's SFTTrainer as it is (accelerate's DDP)")
    parser.add_argument("--zero++", dest="zeropp", action="store_true", help="qwZ + hpZ (the node) + qgZ")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="a local text file, one example per line")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--bf16", action="store_true", help="TRL's default precision (fp32 without it, to compare)")
    parser.add_argument("--out", default="runs/trl_sft", help="losses and checkpoints")
    arguments = parser.parse_args()
    out = Path(arguments.out)
    tokenizer = train_tokenizer(Path(arguments.data), vocab_size=320)  # the same on every rank: deterministic
    tokenizer.pad_token = tokenizer.eos_token
    lines = [line for line in Path(arguments.data).read_text().splitlines() if len(line) > 20]
    dataset = datasets.Dataset.from_dict({"text": lines})
    training = SFTConfig(
        output_dir=str(out), max_steps=arguments.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=arguments.accumulation, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0, logging_steps=5, save_strategy="no", report_to="none",
        use_cpu=True, seed=0, dataloader_drop_last=True, ddp_backend="gloo", max_length=64,
        bf16=arguments.bf16)
    model = tiny_llama(vocab_size=len(tokenizer))
    if arguments.ddp:
        trainer = recording(SFTTrainer)(model=model, args=training, train_dataset=dataset, processing_class=tokenizer)
    else:
        from zeropp import ZeroConfig
        from zeropp.integrations.transformers import sharded_trainer

        node = arguments.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        config = ZeroConfig(quantized_weights=True, hpz_size=node, quantized_gradients=True) if arguments.zeropp \
            else ZeroConfig()
        trainer = recording(sharded_trainer(SFTTrainer))(model=model, args=training, train_dataset=dataset,
                                                         processing_class=tokenizer, zero_config=config,
                                                         ranks_per_node=arguments.ranks_per_node)
    trainer.train()
    write_losses(trainer, out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
