"""``zeropp plan``: every variant's step simulated on the hardware the user names.

Each variant's schedule is recorded from the engine by a dry run (rank 0 of the layout, fake
process group, meta device) and replayed by :mod:`zeropp.simulate` on a hardware
description: a file of ``zeropp/simulate/hardware/`` (``--hardware h100-8gpu``), one of the
user's, or, without ``--hardware``, the one the flags give (``--rank-gflops``,
``--inter-node-mbit``). ``--schedule`` replays a schedule recorded by ``zeropp train
--record-schedule`` instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from zeropp.config import ZeroConfig, standard_variants
from zeropp.models import GPTConfig
from zeropp.simulate.hardware import Hardware
from zeropp.simulate.schedule import Schedule
from zeropp.simulate.simulator import StepTime, simulate
from zeropp_tools.dryrun import DryRun, dry_run_schedule, join_fake_world


def plan_hardware(args) -> Hardware:
    """``--hardware``'s description with the link flags applied, or one from the flags alone."""
    if args.hardware:
        hardware = Hardware.load(args.hardware)
        if args.inter_node_mbit is not None:
            hardware = hardware.with_adapters(1, args.inter_node_mbit * 1e6 / 8)
        return replace(hardware, sustained_flops=args.rank_gflops * 1e9) if args.rank_gflops else hardware
    return Hardware(
        name="given by flags", sustained_flops=(args.rank_gflops or 5.0) * 1e9, slowdown_during_communication=0.0,
        processors=0, tile_m=1, tile_n=1, intra_node_bytes_per_s=math.inf, network_adapters_per_node=1,
        adapter_bytes_per_s=(args.inter_node_mbit or 200.0) * 1e6 / 8, link_efficiency=1.0,
        parallel_flows_adapter_bytes_per_s=0.0, base_latency_s=0.0,
        intra_node_step_latency_s=0.0, inter_node_step_latency_s=50e-6, arrival_skew_s=0.0,
        host_receive_intra_node_bytes_per_s=0.0, host_receive_inter_node_bytes_per_s=0.0, kernel_bytes_per_s=math.inf,
        optimizer_bytes_per_parameter=0, sources={"all": "command-line flags"})


def plan_config(args, config: ZeroConfig) -> ZeroConfig:
    """A standard variant's config with the plan's engine flags applied."""
    return replace(config, activation_checkpointing=args.activation_checkpointing,
                   keep_weights_between_micro_steps=args.keep_weights_between_micro_steps)


def plan_gpt(args) -> GPTConfig:
    """``--model``'s GPT with the shape flags given applied; ``--hf-config`` gives the shape
    of a Hugging Face model (its blocks as GPT blocks of the same hidden size: 12 h^2
    parameters, within a few percent of a LLaMA block's 4 h^2 + 3 h x intermediate)."""
    gpt = GPTConfig.preset(args.model)
    layers, hidden, vocabulary = args.layers, args.hidden, args.vocabulary
    if getattr(args, "hf_config", None):
        shape = _hugging_face_shape(args.hf_config)
        layers, hidden, vocabulary = layers or shape[0], hidden or shape[1], vocabulary or shape[2]
    width = hidden or gpt.embed_dim
    return replace(gpt, num_layers=layers or gpt.num_layers, embed_dim=width,
                   num_heads=max(1, width // 128) if hidden else gpt.num_heads,
                   vocab_size=vocabulary or gpt.vocab_size, block_size=max(gpt.block_size, args.tokens_per_rank))


def _hugging_face_shape(path: str) -> tuple[int, int, int]:
    """(layers, hidden size, vocabulary) of a Hugging Face ``config.json`` (or its folder)."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    config = json.loads(file.read_text())
    names = {"layers": ("num_hidden_layers", "n_layer", "num_layers"), "hidden": ("hidden_size", "n_embd", "d_model"),
             "vocabulary": ("vocab_size",)}
    shape = []
    for what, keys in names.items():
        value = next((config[key] for key in keys if key in config), None)
        if value is None:
            raise ValueError(f"--hf-config {path}: no {what} field; expected one of {list(keys)}")
        shape.append(int(value))
    return shape[0], shape[1], shape[2]


def variant_schedules(args, precision: str = "bf16") -> dict[str, Schedule]:
    """Each standard variant's schedule for the flags' model, layout, batch and accumulation."""
    gpt = plan_gpt(args)
    run = DryRun(layers=gpt.num_layers, hidden=gpt.embed_dim, vocabulary=gpt.vocab_size, nodes=args.nodes,
                 ranks_per_node=args.ranks_per_node, tokens_per_rank=args.tokens_per_rank,
                 activation_checkpointing=args.activation_checkpointing)
    schedules = {}
    for name, config in standard_variants(args.ranks_per_node).items():
        config = replace(plan_config(args, config), compute_dtype=precision, reduce_dtype=precision)
        join_fake_world(run)
        try:
            schedules[name] = dry_run_schedule(run, config, micro_steps=args.accumulation)
        finally:
            dist.destroy_process_group()
    return schedules


def describe(name: str, step: StepTime, tokens_per_step: int) -> str:
    return (f"{name:<8} step {step.step_s * 1e3:9.1f} ms  {tokens_per_step / step.step_s:11,.0f} tokens/s  "
            f"{step.flops / step.step_s / 1e12:7.3g} TFLOP/s per rank  compute {step.compute_s * 1e3:8.1f} ms  "
            f"inter-node {step.inter_node_s * 1e3:8.1f} ms  stalled {step.stalled_s * 1e3:8.1f} ms  "
            f"bounded by {step.bottleneck}")


def simulate_all(schedules: dict[str, Schedule], hardware: Hardware) -> dict[str, StepTime]:
    return {name: simulate(schedule, hardware) for name, schedule in schedules.items()}


def tokens_per_step(schedule: Schedule, micro_steps: int) -> int:
    return schedule.tokens_per_rank * schedule.world_size * micro_steps

