"""The Hugging Face Trainer on zeropp: a tiny Llama-style model trained on a local text
file (UTF-8 bytes as tokens), nothing downloaded. On 4 processes acting as 2 nodes x 2::

    torchrun --nproc-per-node 4 examples/hf_trainer.py --ranks-per-node 2            # ZeRO-3, exact
    torchrun --nproc-per-node 4 examples/hf_trainer.py --ranks-per-node 2 --zero++   # qwZ + hpZ + qgZ
    torchrun --nproc-per-node 4 examples/hf_trainer.py --ddp                         # the Trainer's own DDP

On two machines, each: ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --master-addr
HOST0 --master-port 29500 examples/hf_trainer.py``. Each rank writes its loss per
optimizer step to ``OUT/losses_rank{R}.json``; ``--save`` writes a folder that
``AutoModelForCausalLM.from_pretrained`` loads.
"""

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import transformers

from zeropp.launch import finish_distributed

REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPOSITORY / "docs" / "design.md"  # any local text file will do


class ByteSequences(torch.utils.data.Dataset):
    """Consecutive ``length``-byte pieces of a text file, as ``input_ids`` and ``labels``."""

    def __init__(self, path: Path, length: int) -> None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        self.rows = data[: len(data) // length * length].view(-1, length)  # [rows, length]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def tiny_llama(vocab_size: int = 256) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def recording(trainer_class):
    """``trainer_class`` that keeps what each micro-step's ``training_step`` returned."""

    class Recording(trainer_class):
        micro_step_losses: list[float] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.micro_step_losses.append(loss.item())
            return loss

    return Recording


def write_losses(trainer, out: Path) -> None:
    """Collective. This rank's loss per optimizer step (``losses_rank{R}.json``) and their
    mean over ranks (``losses.json``, comparable at any world size)."""
    losses, accumulation = trainer.micro_step_losses, trainer.args.gradient_accumulation_steps
    per_step = [sum(losses[i:i + accumulation]) for i in range(0, len(losses), accumulation)]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses_rank{trainer.args.process_index}.json").write_text(json.dumps(per_step))
    mean = torch.tensor(per_step, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    if trainer.args.process_index == 0:
        (out / "losses.json").write_text(json.dumps((mean / trainer.args.world_size).tolist()))


def end_distributed() -> None:
    """Collective. Ends the process group once the training objects are gone; call it after
    the function that trained returns. A DDP model still alive at
    ``destroy_process_group`` holds the group until Python frees the model, and freeing it
    then stops gloo's worker threads with the GIL held: a worker that needs the GIL to free a
    finished collective's tensor never ends, and the run hangs after its last step."""
    gc.collect()  # the trainer's reference cycles, DDP's reducer among them, go while the group lives
    assert not any(isinstance(alive, torch.nn.parallel.DistributedDataParallel) for alive in gc.get_objects()), \
        "a DDP model outlives training: ending the group could hang"
    finish_distributed()  # every rank done, then the group destroyed: no gloo thread outlives Python


def example_parser(description: str, ddp_help: str) -> argparse.ArgumentParser:
    """The flags every trainer example takes: the DDP baseline, the layout, data and schedule."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ddp", action="store_true", help=ddp_help)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="a local text file")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    return parser


def node_size(arguments) -> int:
    """Ranks per node: as given, else torchrun's LOCAL_WORLD_SIZE."""
    return arguments.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def train(arguments) -> None:
    """Trains, writes the losses and, with --save, the model folder."""
    out = Path(arguments.out)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=arguments.steps, per_device_train_batch_size=arguments.batch_per_rank,
        gradient_accumulation_steps=arguments.accumulation, learning_rate=3e-3, lr_scheduler_type="cosine",
        warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0, logging_steps=5, report_to="none",
        save_strategy="steps" if arguments.checkpoint_every else "no", save_steps=arguments.checkpoint_every or 500,
        use_cpu=True, seed=0, dataloader_drop_last=True, ddp_backend="gloo")
    dataset = ByteSequences(Path(arguments.data), length=65)
    if arguments.ddp:
        trainer = recording(transformers.Trainer)(model=tiny_llama(), args=training, train_dataset=dataset)
    else:
        from zeropp import ZeroConfig
        from zeropp.integrations.transformers import ZeroppTrainer

        zero_plus_plus = dict(quantized_weights=True, hpz_size=node_size(arguments), quantized_gradients=True)
        config = ZeroConfig(**zero_plus_plus) if arguments.zeropp else ZeroConfig()
        trainer = recording(ZeroppTrainer)(model=tiny_llama(), args=training, train_dataset=dataset,
                                           zero_config=config, ranks_per_node=arguments.ranks_per_node)
    trainer.train(resume_from_checkpoint=arguments.resume)
    write_losses(trainer, out)
    if arguments.save:
        trainer.save_model(str(out / "model"))
        batch = dataset[0]["input_ids"][None]  # [1, 65]
        with torch.no_grad():
            logits = trainer.model_wrapped(input_ids=batch).logits  # every rank: the forward gathers
        if training.process_index == 0:
            torch.save(logits, out / "logits.pt")


def main() -> None:
    parser = example_parser(__doc__, "the plain Trainer (accelerate's DDP), for comparison")
    parser.add_argument("--zero++", dest="zeropp", action="store_true", help="qwZ + hpZ (the node) + qgZ")
    parser.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per micro-step")
    parser.add_argument("--out", default="runs/hf_trainer", help="losses, checkpoints, the saved model")
    parser.add_argument("--save", action="store_true", help="write OUT/model for from_pretrained")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from, at any world size")
    arguments = parser.parse_args()
    train(arguments)
    end_distributed()


if __name__ == "__main__":
    main()
