"""The training job behind ``zeropp demo`` and ``zeropp train``: one function per rank."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..config import ZeroConfig
from ..engine import ShardedModel
from ..memory import peak_resident_bytes, process_resources, resident_bytes, resting_bytes_sharded
from ..models import GPTConfig
from ..optim import ShardedOptimizer
from ..topology import Topology
from .job import Job, build_job, model_name


SAVE_ERROR_POLICIES = ("stop", "continue")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    model_size: str = "small"
    steps: int = 300
    batch_per_rank: int = 8
    seq_len: int = 128
    accumulation: int = 1
    node_accumulation: bool = True  # micro-steps before the last reduce inside the node only (model.no_sync)
    untimed_steps: int = 5  # first steps left out of the summary's median step time (allocation, caches, hpZ copy)
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 0
    ranks_per_node: int | None = None
    metrics_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0 saves only at the end
    resume: bool = False  # continue from checkpoint_dir's latest checkpoint when there is one
    on_save_error: str = "stop"  # a checkpoint that cannot be saved: "stop" the run, or "continue" without it
    record_resources: bool = False  # add every rank's resident memory, open files and threads to the metrics
    collective_timeout_s: float = 300.0
    hf_model: str | None = None  # a Hugging Face model folder to fine-tune instead of the built-in GPT
    data_path: str | None = None  # a text file to train on instead of the built-in corpus
    export_dir: str | None = None  # write the trained model here (Hugging Face folder, or model.safetensors)
    schedule_path: str | None = None  # rank 0 writes its last step's schedule here (zeropp.simulate replays it)
    zero: ZeroConfig = field(default_factory=ZeroConfig)

    def __post_init__(self) -> None:
        if self.hf_model is None:
            GPTConfig.preset(self.model_size)
        for name in ("steps", "batch_per_rank", "seq_len", "accumulation", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.untimed_steps < 0:
            raise ValueError(f"untimed_steps must be >= 0, got {self.untimed_steps}")
        if self.on_save_error not in SAVE_ERROR_POLICIES:
            raise ValueError(f"on_save_error={self.on_save_error!r}; allowed values: {list(SAVE_ERROR_POLICIES)}")
        if self.hf_model is None and self.seq_len > GPTConfig.preset(self.model_size).block_size:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the {self.model_size} model's block_size="
                f"{GPTConfig.preset(self.model_size).block_size}"
            )

    def model_config(self) -> GPTConfig:
        return GPTConfig.preset(self.model_size)


def learning_rate_at(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(rank: int, world_size: int, config: TrainConfig) -> dict:
    """Train the GPT on this rank; returns a summary (identical on every rank)."""
    baseline_bytes = resident_bytes()  # before the model exists: its growth is the training's
    torch.manual_seed(config.seed)
    topology = Topology.from_environment(config.ranks_per_node, timeout_s=config.collective_timeout_s)
    job = build_job(config, topology)
    model, corpus = job.model, job.corpus
    optimizer = ShardedOptimizer(
        model, lambda params: torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    )
    first_step = _maybe_resume(model, optimizer, config)
    metrics = open(config.metrics_path, "a" if first_step else "w") if rank == 0 and config.metrics_path else None
    tokens_per_step = world_size * config.batch_per_rank * config.seq_len * config.accumulation
    step_times, exposed, losses, comm_table, record = [], [], [], {}, {}
    # Bars only for a person at a terminal; logs and CI get the metrics file instead.
    progress = tqdm(
        range(first_step, config.steps), initial=first_step, total=config.steps,
        disable=rank != 0 or not sys.stderr.isatty(), desc="train", unit="step",
    )
    try:
        for step in progress:
            model.comm_log.reset()
            model.communicator.take_wait_seconds()
            started = time.perf_counter()
            with _maybe_record_schedule(model, config, step, rank):
                loss = _train_step(job, optimizer, config, step, rank, world_size)
            step_times.append(time.perf_counter() - started)
            exposed.append(model.communicator.take_wait_seconds())
            comm_table = model.comm_log.totals_by_phase()
            losses.append(loss)
            record = {"step": step, "loss": loss, "lr": learning_rate_at(config, step),
                      "tokens_per_s": tokens_per_step / step_times[-1], "comm": comm_table,
                      "step_s": step_times[-1], "exposed_comm_s": exposed[-1],
                      "skipped_steps": optimizer.skipped_steps}
            if model.auto_tuner is not None:
                record["auto_choice"] = model.auto_tuner.choice
            if config.record_resources:
                record["resources"] = _gather_resources(world_size)
            quantization_error = model.weight_quantization_error()
            if quantization_error is not None:
                record["weight_quantization_error"] = quantization_error
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                record["validation_loss"] = evaluate(job, config, rank, world_size)
            progress.set_postfix(loss=f"{loss:.3f}")
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            _maybe_save(model, optimizer, config, step + 1)
    finally:
        if metrics:
            metrics.close()
    untimed = min(config.untimed_steps, len(step_times) - 1)
    timed = step_times[untimed:]
    validation = record["validation_loss"] if "validation_loss" in record else evaluate(job, config, rank, world_size)
    if config.export_dir:
        job.export(config.export_dir)
    lifetime = [None] * world_size  # every rank's bytes over the whole run, init and evaluation included
    dist.all_gather_object(lifetime, dict(model.comm_log.lifetime))
    resting = torch.tensor(resting_bytes_sharded(model, optimizer), dtype=torch.float64, device=topology.device)
    dist.all_reduce(resting, op=dist.ReduceOp.MAX)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_resident_bytes() - baseline_bytes)
    return {
        "config": _describe(config, topology, model),
        "final_train_loss": losses[-1] if losses else None,
        "validation_loss": validation,
        "tokens_per_s": tokens_per_step / statistics.median(timed) if timed else None,
        "median_step_s": statistics.median(timed) if timed else None,
        "median_exposed_comm_s": statistics.median(exposed[untimed:]) if exposed else None,
        "comm_per_step": comm_table,
        "losses": losses,
        "comm_total_by_rank": lifetime,
        # Most bytes any rank holds between steps: shards, gradients, optimizer state and
        # what the weight gather keeps (hpZ parts, quantized caches, delta copies).
        "resting_bytes_per_rank": int(resting.item()),
        # Each rank's peak resident set over the run above what it held before building the
        # model: everything training allocated, allocator slack included.
        "peak_rss_increase_bytes_by_rank": peaks,
        "first_step": first_step,
        "skipped_steps": optimizer.skipped_steps,
        "auto_decisions": [asdict(decision) for decision in model.auto_tuner.decisions] if model.auto_tuner else None,
    }


def _gather_resources(world_size: int) -> list[dict[str, int]]:
    everyone = [None] * world_size
    dist.all_gather_object(everyone, process_resources())
    return everyone


def _maybe_resume(model, optimizer, config: TrainConfig) -> int:
    """The step to start from: 0, or the step of the latest checkpoint when resuming."""
    if not (config.resume and config.checkpoint_dir and (Path(config.checkpoint_dir) / "latest").exists()):
        return 0
    return load_checkpoint(model, optimizer, config.checkpoint_dir).step


def _maybe_save(model, optimizer, config: TrainConfig, completed: int) -> None:
    """Save after ``completed`` steps on the configured cadence, and at the end."""
    if not config.checkpoint_dir:
        return
    periodic = config.checkpoint_every and completed % config.checkpoint_every == 0
    if not (periodic or completed == config.steps):
        return
    try:
        save_checkpoint(model, optimizer, config.checkpoint_dir, step=completed, extra={"data_step": completed})
    except CheckpointError as error:
        if config.on_save_error == "stop":
            raise
        if model.topology.rank == 0:
            logger.warning("step %d: %s; training continues (on_save_error='continue')", completed, error)


@contextlib.contextmanager
def _maybe_record_schedule(model, config: TrainConfig, step: int, rank: int):
    """On rank 0's last step, record the schedule it issues and write it to ``schedule_path``."""
    if rank != 0 or config.schedule_path is None or step != config.steps - 1:
        yield
        return
    with model.record_schedule() as recorder:
        yield
    schedule = recorder.schedule
    schedule.tokens_per_rank = config.batch_per_rank * config.seq_len
    schedule.optimizer_parameters = sum(parameter.numel() for parameter in model.master_parameters())
    Path(config.schedule_path).parent.mkdir(parents=True, exist_ok=True)
    schedule.save(config.schedule_path)


def _train_step(job: Job, optimizer, config, step, rank, world_size) -> float:
    model, corpus = job.model, job.corpus
    model.set_training_step(step)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate_at(config, step)
    device = model.topology.device
    total = torch.zeros((), device=device)
    for micro in range(config.accumulation):
        inputs, targets = corpus.rank_batch(
            "train", step * config.accumulation + micro, config.batch_per_rank, config.seq_len, rank, world_size, config.seed
        )
        inputs, targets = inputs.to(device), targets.to(device)
        model.set_requires_gradient_sync(not config.node_accumulation or micro == config.accumulation - 1)
        loss = job.loss(model, inputs, targets) / config.accumulation
        optimizer.scale_loss(loss).backward()
        total += loss.detach().float()
    optimizer.clip_grad_norm_(config.clip)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(total)
    return total.item() / world_size


@torch.no_grad()
def evaluate(job: Job, config, rank, world_size) -> float:
    model, corpus = job.model, job.corpus
    model.eval()
    device = model.topology.device
    total = torch.zeros((), device=device)
    for batch in range(config.eval_batches):
        # The same validation batches whatever the run's seed, so seeds compare fairly.
        inputs, targets = corpus.rank_batch("validation", batch, config.batch_per_rank, config.seq_len, rank, world_size)
        total += job.loss(model, inputs.to(device), targets.to(device)).float()
    model.train()
    dist.all_reduce(total)
    return total.item() / (world_size * config.eval_batches)


def _describe(config: TrainConfig, topology: Topology, model: ShardedModel) -> dict:
    described = asdict(config)
    described["model"] = model_name(config)
    described["num_parameters"] = sum(flat.numel for flat in model.flat_params())
    described["world_size"] = topology.world_size
    described["num_nodes"] = topology.num_nodes
    described["ranks_per_node"] = topology.ranks_per_node
    return described


def write_summary(summary: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
