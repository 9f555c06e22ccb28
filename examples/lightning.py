"""PyTorch Lightning's Trainer on zeropp: the tiny Llama-style model of hf_trainer.py in a
LightningModule, trained on a local text file (UTF-8 bytes as tokens), nothing downloaded.
On 4 processes acting as 2 nodes x 2::

    torchrun --nproc-per-node 4 examples/lightning.py --ranks-per-node 2            # ZeRO-3, exact
    torchrun --nproc-per-node 4 examples/lightning.py --ranks-per-node 2 --zero++   # qwZ + hpZ + qgZ
    torchrun --nproc-per-node 4 examples/lightning.py --ddp                         # Lightning's own DDP

``--fabric`` runs the same training as a Lightning Fabric loop (``ZeroppFabricStrategy``).

On two machines, each: ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --master-addr
HOST0 --master-port 29500 examples/lightning.py``. An epoch is ``--steps-per-epoch``
optimizer steps; ``--checkpoint`` writes a checkpoint folder after each epoch's last step
(Lightning restarts a data loader at the start of an epoch, so a resumed run sees the
batches the uninterrupted one did) and ``--resume FOLDER`` continues from one, at any
world size. Each rank writes its loss per optimizer step to ``OUT/losses_rank{R}.json``.
"""

import json
import os
import sys
from pathlib import Path

# Python puts this script's folder first on sys.path, where this file would stand in for the
# lightning package: look there last (for hf_trainer.py's helpers) instead.
EXAMPLES = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != EXAMPLES] + [str(EXAMPLES)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hf_trainer import ByteSequences, end_distributed, example_parser, node_size, tiny_llama  # noqa: E402


class CausalLanguageModel(pl.LightningModule):
    """A Hugging Face causal LM with AdamW and a cosine schedule with warm-up, per step."""

    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.total_steps = total_steps
        self.micro_step_losses: list[float] = []

    def training_step(self, batch: dict, batch_index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.micro_step_losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        schedule = transformers.get_cosine_schedule_with_warmup(optimizer, 3, self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def write_losses(module: CausalLanguageModel, accumulation: int, out: Path) -> None:
    """Collective. This rank's mean loss per optimizer step and their mean over ranks."""
    losses = module.micro_step_losses
    per_step = [sum(losses[i:i + accumulation]) / accumulation for i in range(0, len(losses), accumulation)]
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses_rank{rank}.json").write_text(json.dumps(per_step))
    mean = torch.tensor(per_step, dtype=torch.float64)
    torch.distributed.all_reduce(mean)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps((mean / world_size).tolist()))


def fabric_training(arguments, strategy, dataset) -> list[float]:
    """The Trainer's run as a Fabric loop; returns this rank's loss per micro-step."""
    import lightning.fabric

    fabric = lightning.fabric.Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                     num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                     strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=arguments.empty_init):  # meta: zeropp initialises unit by unit
        model = tiny_llama()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    schedule = transformers.get_cosine_schedule_with_warmup(optimizer, 3, arguments.steps)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}
    if arguments.resume:
        fabric.load(arguments.resume, state)
    batches = iter(fabric.setup_dataloaders(
        torch.utils.data.DataLoader(dataset, batch_size=arguments.batch_per_rank, drop_last=True)))
    for _ in range(state["step"] * arguments.accumulation):  # the batches the checkpointed run used
        next(batches)
    losses = []
    for step in range(state["step"], arguments.steps):
        for micro_step in range(arguments.accumulation):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro_step < arguments.accumulation - 1):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                fabric.backward(loss / arguments.accumulation)
            losses.append(loss.item())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if arguments.checkpoint and (step + 1) % arguments.steps_per_epoch == 0:
            fabric.save(Path(arguments.out) / "checkpoints" / f"step={step + 1}", {**state, "step": step + 1})
    return losses


def train(arguments) -> None:
    """Trains (the Trainer, or a Fabric loop) and writes the losses."""
    out = Path(arguments.out)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dataset = ByteSequences(Path(arguments.data), length=65)
    if arguments.ddp:
        strategy_class, options = pl.strategies.DDPStrategy, dict(process_group_backend="gloo")
        if arguments.fabric:
            from lightning.fabric.strategies import DDPStrategy as strategy_class
    else:
        from zeropp import ZeroConfig
        from zeropp.integrations.lightning import ZeroppFabricStrategy, ZeroppStrategy

        zero_plus_plus = dict(quantized_weights=True, hpz_size=node_size(arguments), quantized_gradients=True)
        config = ZeroConfig(**zero_plus_plus) if arguments.zeropp else ZeroConfig()
        strategy_class = ZeroppFabricStrategy if arguments.fabric else ZeroppStrategy
        options = dict(config=config, ranks_per_node=arguments.ranks_per_node)
    if arguments.fabric:
        module = CausalLanguageModel(arguments.steps)  # only to keep the losses
        module.micro_step_losses = fabric_training(arguments, strategy_class(**options), dataset)
        write_losses(module, arguments.accumulation, out)
        return
    strategy = strategy_class(**options)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}", save_top_k=-1,
                                               every_n_train_steps=arguments.steps_per_epoch)
    trainer = pl.Trainer(
        accelerator="cpu", devices=local_world_size, num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_world_size,
        strategy=strategy, max_steps=arguments.steps, limit_train_batches=arguments.steps_per_epoch * arguments.accumulation,
        accumulate_grad_batches=arguments.accumulation, gradient_clip_val=1.0, callbacks=[checkpoints] if arguments.checkpoint else [],
        enable_checkpointing=arguments.checkpoint, logger=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=arguments.batch_per_rank, drop_last=True)
    module = CausalLanguageModel(arguments.steps)
    trainer.fit(module, loader, ckpt_path=arguments.resume)
    write_losses(module, arguments.accumulation, out)


def main() -> None:
    parser = example_parser(__doc__, "Lightning's DDP strategy, for comparison")
    parser.add_argument("--zero++", dest="zeropp", action="store_true", help="qwZ + hpZ (the node) + qgZ")
    parser.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per micro-step")
    parser.add_argument("--steps-per-epoch", type=int, default=10, help="optimizer steps per epoch")
    parser.add_argument("--out", default="runs/lightning", help="losses and checkpoints")
    parser.add_argument("--checkpoint", action="store_true", help="a checkpoint folder at the end of each epoch")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from, at any world size")
    parser.add_argument("--fabric", action="store_true", help="a Lightning Fabric loop instead of the Trainer")
    parser.add_argument("--empty-init", action="store_true", help="Fabric: build the model on the meta device")
    arguments = parser.parse_args()
    train(arguments)
    end_distributed()


if __name__ == "__main__":
    main()
