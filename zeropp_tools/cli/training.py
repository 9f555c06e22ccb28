"""``zeropp train``: settings from flags (and a DeepSpeed file), the run, its report."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from zeropp.accounting import format_table
from zeropp.config import ZeroConfig
from zeropp.launch import finish_distributed, init_from_torchrun, spawn_ranks
from zeropp.topology import Layout
from zeropp.train import TrainConfig, train
from zeropp.train.loop import write_summary

from .deepspeed_options import merge_with_file
from .run_folder import run_folder

logger = logging.getLogger(__name__)

SPAWN_TIMEOUT_S = 24 * 3600  # a long run is legitimate; a hung one fails on --timeout instead


def run_training(arguments, explicit: set[str] = frozenset()) -> int:
    """Validate everything that can be checked here, then create the output folder and
    train: a typo fails fast and leaves no folder behind."""
    under_torchrun = "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ
    ranks_per_node = _ranks_per_node(arguments, under_torchrun)
    config = training_config(arguments, explicit, ranks_per_node)
    if not under_torchrun:
        config.zero.check_layout(Layout(arguments.world_size, ranks_per_node).ranks_per_node)
    if under_torchrun and os.environ["RANK"] != "0":
        # Only rank 0 writes metrics and the summary, so only it makes (and may clean) the folder.
        _train_under_torchrun(arguments, config)
        return 0
    out = Path(arguments.out)
    with run_folder(out):
        summary = _train_under_torchrun(arguments, config) if under_torchrun else _train_spawned(arguments, config)
        write_summary(summary, out / "summary.json")
    logger.info(training_report(summary, out))
    return 0


def _ranks_per_node(arguments, under_torchrun: bool) -> int | None:
    if arguments.ranks_per_node is not None or under_torchrun:
        return arguments.ranks_per_node  # None under torchrun: LOCAL_WORLD_SIZE decides
    return 2 if arguments.world_size % 2 == 0 else 1


def training_config(arguments, explicit: set[str], ranks_per_node: int | None) -> TrainConfig:
    zero, training = zero_config(arguments, explicit)
    return TrainConfig(
        model_size=arguments.model, steps=arguments.steps, seq_len=arguments.seq_len, learning_rate=arguments.lr,
        seed=arguments.seed,
        batch_per_rank=training.get("train_micro_batch_size_per_gpu", arguments.batch_per_rank),
        accumulation=training.get("gradient_accumulation_steps", arguments.accumulation),
        node_accumulation=not arguments.reduce_every_micro_step, untimed_steps=arguments.untimed_steps,
        clip=training.get("gradient_clipping", 1.0),
        ranks_per_node=ranks_per_node, metrics_path=str(Path(arguments.out) / "metrics.jsonl"), zero=zero,
        checkpoint_dir=arguments.checkpoint_dir, checkpoint_every=arguments.checkpoint_every, resume=arguments.resume,
        collective_timeout_s=arguments.timeout, hf_model=arguments.hf_config, data_path=arguments.data,
        export_dir=arguments.export, schedule_path=arguments.record_schedule,
    )


def zero_config(arguments, explicit: set[str]) -> tuple[ZeroConfig, dict]:
    """The ZeroConfig of the flags, merged with --deepspeed-config when given, and the
    file's training settings ({} without a file)."""
    intra, inter = arguments.gradient_bits
    zero = ZeroConfig(
        compute_dtype=arguments.precision, reduce_dtype=arguments.reduce_dtype,
        activation_checkpointing=arguments.checkpointing,
        quantized_weights=arguments.qwz, weight_bits=arguments.weight_bits, hpz_size=arguments.hpz,
        quantized_gradients=arguments.qgz, gradient_bits_intra_node=intra, gradient_bits_inter_node=inter,
        gradient_grid_inter_node=arguments.gradient_grid, gradient_scale_dtype=arguments.gradient_scale_dtype,
        quantization_block_size=arguments.block_size,
        gradient_chunks=arguments.gradient_chunks, compile_quantization=arguments.compile_quantization,
        two_hop_weight_gather=arguments.two_hop_gather, late_bits_from_step=arguments.late_bits_from_step,
        late_weight_bits=arguments.late_weight_bits, late_gradient_bits_inter_node=arguments.late_gradient_bits,
        auto=arguments.auto, auto_probe_every=arguments.auto_probe_every,
        weight_deltas=arguments.weight_deltas, weight_delta_bits=arguments.weight_delta_bits,
        prefetch_units=arguments.prefetch_units,
        keep_weights_between_micro_steps=arguments.keep_weights_between_micro_steps,
    )
    if not arguments.deepspeed_config:
        return zero, {}
    return merge_with_file(arguments, explicit, zero)


def _train_spawned(arguments, config: TrainConfig) -> dict:
    results = spawn_ranks(train, arguments.world_size, (config,), timeout_s=SPAWN_TIMEOUT_S,
                          collective_timeout_s=arguments.timeout)
    return results[0]


def _train_under_torchrun(arguments, config: TrainConfig) -> dict:
    rank, world_size = init_from_torchrun(arguments.timeout)
    summary = train(rank, world_size, config)
    finish_distributed()  # a rank that exits while peers still read makes gloo abort them
    return summary


def training_report(summary: dict, out: Path) -> str:
    config = summary["config"]
    zero = config["zero"]
    lines = [
        f"model: {config['model']}, {config['num_parameters']:,} parameters; "
        f"world: {config['world_size']} ranks = {config['num_nodes']} nodes x {config['ranks_per_node']}; "
        f"precision: {zero['compute_dtype']}; qwZ {zero['quantized_weights']}, "
        f"hpZ size {zero['hpz_size']}, qgZ {zero['quantized_gradients']}",
        f"train loss {summary['final_train_loss']:.4f}   validation loss {summary['validation_loss']:.4f}   "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step)",
        "",
        "communication per step, this rank (rank 0):",
        format_table(summary["comm_per_step"]),
        "",
        f"metrics: {out / 'metrics.jsonl'}   summary: {out / 'summary.json'}",
    ]
    return "\n".join(lines)
