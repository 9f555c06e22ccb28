"""PEFT LoRA through the Hugging Face Trainer on zeropp: the frozen base travels as MixZ++
(INT8, kept inside the node after its first gather with hpZ), the adapters in fp32. A tiny
Llama-style model on a local text file, nothing downloaded. On 4 processes as 2 nodes x 2::

    torchrun --nproc-per-node 4 examples/peft_lora.py --ranks-per-node 2 --save   # MixZ++ + hpZ
    torchrun --nproc-per-node 4 examples/peft_lora.py --ddp                       # PEFT under DDP

Each rank writes its loss per optimizer step to ``OUT/losses_rank{R}.json``; rank 0 writes
node 0's cross-node gather bytes per step, measured and predicted (``OUT/bytes.json``).
``--save`` writes the adapter folder ``PeftModel.from_pretrained`` loads (``OUT/adapter``).
"""

import json
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

from hf_trainer import ByteSequences, end_distributed, example_parser, node_size, recording, tiny_llama, write_losses

GATHERS = ("forward_gather", "backward_gather")


def lora_model() -> torch.nn.Module:
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(tiny_llama(), config)


class GatherBytes(transformers.TrainerCallback):
    """Cross-node bytes this rank's gathers received in each optimizer step, beside the
    accounting's prediction for a step after the first."""

    def __init__(self, sharded, accumulation: int) -> None:
        self.sharded, self.accumulation, self.steps = sharded, accumulation, []

    def on_step_end(self, args, state, control, **kwargs):
        measured = self.sharded.comm_log.totals_by_phase()
        predicted = self.sharded.predicted_step_bytes(self.accumulation, node_accumulation=True)
        self.steps.append({"measured": sum(measured[phase]["received_inter_node"] for phase in GATHERS),
                           "predicted": sum(predicted[phase]["received_inter_node"] for phase in GATHERS)})
        self.sharded.comm_log.reset()


def train(arguments) -> None:
    """Trains, writes the losses and the bytes and, with --save, the adapter folder."""
    out = Path(arguments.out)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=arguments.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=arguments.accumulation, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=3, max_grad_norm=1.0, logging_steps=5, save_strategy="no", report_to="none", use_cpu=True,
        seed=0, dataloader_drop_last=True, ddp_backend="gloo")
    dataset = ByteSequences(Path(arguments.data), length=65)
    recorder, model = None, lora_model()
    adapters = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    if arguments.ddp:
        trainer = recording(transformers.Trainer)(model=model, args=training, train_dataset=dataset)
    else:
        from zeropp import ZeroConfig
        from zeropp.integrations.transformers import ZeroppTrainer

        config = ZeroConfig(quantized_nontrainable_weights=True, hpz_size=node_size(arguments))
        trainer = recording(ZeroppTrainer)(model=model, args=training, train_dataset=dataset,
                                           zero_config=config, ranks_per_node=arguments.ranks_per_node)
        recorder = GatherBytes(trainer.sharded, arguments.accumulation)
        trainer.add_callback(recorder)
    trainer.train()
    write_losses(trainer, out)
    if recorder is not None and training.process_index == 0:
        (out / "bytes.json").write_text(json.dumps({"steps": recorder.steps, "adapter_parameters": adapters}))
    if arguments.save:
        trainer.save_model(str(out / "adapter"))
        batch = dataset[0]["input_ids"][None]  # [1, 65]
        with torch.no_grad():
            logits = trainer.model_wrapped(input_ids=batch).logits
        if training.process_index == 0:
            torch.save(logits, out / "logits.pt")


def main() -> None:
    parser = example_parser(__doc__, "PEFT under the plain Trainer (accelerate's DDP)")
    parser.add_argument("--out", default="runs/peft_lora", help="losses, bytes, the adapter")
    parser.add_argument("--save", action="store_true", help="write OUT/adapter for PeftModel.from_pretrained")
    arguments = parser.parse_args()
    train(arguments)
    end_distributed()


if __name__ == "__main__":
    main()
