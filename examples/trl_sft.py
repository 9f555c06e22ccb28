"""TRL's SFTTrainer on zeropp: supervised fine-tuning of a tiny Llama-style model on the
lines of a local text file, with a byte-level tokenizer trained on it (nothing
downloaded). On 4 processes acting as 2 nodes x 2::

    torchrun --nproc-per-node 4 examples/trl_sft.py --ranks-per-node 2            # ZeRO-3, exact
    torchrun --nproc-per-node 4 examples/trl_sft.py --ranks-per-node 2 --zero++   # qwZ + hpZ + qgZ
    torchrun --nproc-per-node 4 examples/trl_sft.py --ddp                         # TRL on accelerate's DDP

Each rank writes its loss per optimizer step to ``OUT/losses_rank{R}.json``.
"""

from pathlib import Path

import datasets
import torch
from trl import SFTConfig, SFTTrainer

from hf_trainer import end_distributed, example_parser, node_size, recording, tiny_llama, write_losses
from make_hf_model import train_tokenizer


def train(arguments) -> None:
    """Trains and writes the losses."""
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

        zero_plus_plus = dict(quantized_weights=True, hpz_size=node_size(arguments), quantized_gradients=True)
        config = ZeroConfig(**zero_plus_plus) if arguments.zeropp else ZeroConfig()
        trainer = recording(sharded_trainer(SFTTrainer))(model=model, args=training, train_dataset=dataset,
                                                         processing_class=tokenizer, zero_config=config,
                                                         ranks_per_node=arguments.ranks_per_node)
    trainer.train()
    write_losses(trainer, out)


def main() -> None:
    parser = example_parser(__doc__, "TRL's SFTTrainer as it is (accelerate's DDP)")  # --data: one example a line
    parser.add_argument("--zero++", dest="zeropp", action="store_true", help="qwZ + hpZ (the node) + qgZ")
    parser.add_argument("--bf16", action="store_true", help="TRL's default precision (fp32 without it, to compare)")
    parser.add_argument("--out", default="runs/trl_sft", help="losses and checkpoints")
    arguments = parser.parse_args()
    train(arguments)
    end_distributed()


if __name__ == "__main__":
    main()
