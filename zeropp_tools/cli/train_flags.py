"""The flags of ``zeropp train``, in argument groups by what they configure."""

from __future__ import annotations

import argparse
from dataclasses import fields

from zeropp.config import ZeroConfig

from .values import (
    BIT_WIDTHS, DELTA_BIT_WIDTHS, GRADIENT_GRIDS, GRADIENT_SCALE_DTYPES, MODEL_SIZES, PRECISIONS, gradient_bit_pair, non_negative_int,
    positive_float, positive_int,
)


def add_train_arguments(trainer: argparse.ArgumentParser) -> None:
    _add_model_and_data(trainer.add_argument_group("model and data"))
    _add_optimization(trainer.add_argument_group("optimization and precision"))
    _add_communication(trainer.add_argument_group("ZeRO++ communication"))
    config_file = trainer.add_argument_group("configuration file")
    config_file.add_argument(
        "--deepspeed-config", default=None, metavar="FILE",
        help="DeepSpeed-style JSON (zero_optimization, bf16/fp16, train_micro_batch_size_per_gpu, "
             "gradient_accumulation_steps, gradient_clipping); a flag given on the command line that sets "
             "one of its settings to another value is an error",
    )
    _add_checkpoints(trainer.add_argument_group("checkpoints"))
    _add_launch(trainer.add_argument_group("launch and output"))


# ZeroConfig field -> its flag in ``zeropp train`` (a bool is a switch); the gradient bits
# are one flag for two fields.
_SCHEME_FLAGS = {
    "quantized_weights": "--qwz", "weight_bits": "--weight-bits", "two_hop_weight_gather": "--two-hop-gather",
    "hpz_size": "--hpz", "quantized_gradients": "--qgz", "gradient_grid_inter_node": "--gradient-grid",
    "weight_deltas": "--weight-deltas", "weight_delta_bits": "--weight-delta-bits", "auto": "--auto",
    "compile_quantization": "--compile-quantization", "prefetch_units": "--prefetch-units",
    "keep_weights_between_micro_steps": "--keep-weights-between-micro-steps",
}
_GRADIENT_BITS = ("gradient_bits_intra_node", "gradient_bits_inter_node")


def scheme_flags(overrides: dict[str, object]) -> list[str]:
    """The ``zeropp train`` flags that set ``overrides`` (ZeroConfig fields); fields left
    at their defaults need none."""
    default = {field.name: field.default for field in fields(ZeroConfig)}
    unknown = sorted(set(overrides) - set(_SCHEME_FLAGS) - set(_GRADIENT_BITS))
    if unknown:
        raise ValueError(f"no zeropp train flag sets {unknown}; flags exist for {[*_SCHEME_FLAGS, *_GRADIENT_BITS]}")
    flags: list[str] = []
    for name, flag in _SCHEME_FLAGS.items():
        value = overrides.get(name, default[name])
        if value != default[name]:
            flags += [flag] if isinstance(value, bool) else [flag, str(value)]
    intra, inter = (overrides.get(name, default[name]) for name in _GRADIENT_BITS)
    if (intra, inter) != tuple(default[name] for name in _GRADIENT_BITS):
        flags += ["--gradient-bits", f"{intra},{inter}"]
    return flags


def _add_model_and_data(group) -> None:
    group.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size")
    group.add_argument("--hf-config", default=None, metavar="DIR",
                       help="fine-tune a Hugging Face causal LM instead of the GPT: a local folder with config.json, "
                            "optionally safetensors weights (else a random start) and tokenizer files (else bytes)")
    group.add_argument("--data", default=None, metavar="FILE",
                       help="a UTF-8 text file to train on (last tenth for validation) instead of the built-in corpus")
    group.add_argument("--export", default=None, metavar="DIR",
                       help="after training, write the model there: config.json + model.safetensors that "
                            "from_pretrained loads (Hugging Face), or model.safetensors (GPT)")
    group.add_argument("--seq-len", type=positive_int, default=128,
                       help="tokens per sequence (at most the model's block size)")
    group.add_argument("--batch-per-rank", type=positive_int, default=8, help="sequences per rank per micro-step")
    group.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data order")


def _add_optimization(group) -> None:
    group.add_argument("--steps", type=positive_int, default=300, help="optimizer steps")
    group.add_argument("--lr", type=positive_float, default=3e-3,
                       help="peak AdamW learning rate (warm-up, then cosine decay)")
    group.add_argument("--accumulation", type=positive_int, default=1,
                       help="micro-steps accumulated per optimizer step; gradients cross nodes once per step")
    group.add_argument("--reduce-every-micro-step", action="store_true",
                       help="with --accumulation: reduce across nodes in every micro-step instead of keeping node sums")
    group.add_argument("--keep-weights-between-micro-steps", action="store_true",
                       help="with --accumulation: keep every unit gathered from the first micro-step to the last "
                            "(no gathers after the first forward; costs the full weights per rank)")
    group.add_argument("--untimed-steps", type=int, default=5,
                       help="first steps left out of the summary's median step time and tokens/s")
    group.add_argument("--precision", default="fp32", choices=PRECISIONS, help="compute dtype of gathered weights")
    group.add_argument("--reduce-dtype", default=None, choices=PRECISIONS,
                       help="dtype gradients are communicated in (default: the compute dtype)")
    group.add_argument("--checkpointing", action="store_true",
                       help="activation checkpointing: recompute each block in backward instead of storing it")


def _add_communication(group) -> None:
    group.add_argument("--auto", action="store_true",
                       help="auto mode: probe the links, pick qwZ/hpZ/qgZ/two-hop for them, re-plan when they change "
                            "(not with --qwz, --hpz, --qgz, --two-hop-gather, --weight-deltas)")
    group.add_argument("--auto-probe-every", type=positive_int, default=5,
                       help="auto mode: training steps between two probes of the inter-node link")
    group.add_argument("--qwz", action="store_true", help="qwZ: block-quantized weight all-gather")
    group.add_argument("--weight-bits", type=int, default=8, choices=BIT_WIDTHS, help="qwZ bits per weight")
    group.add_argument("--two-hop-gather", action="store_true",
                       help="gather weights in two hops: this node's shards exact, only other nodes' across")
    group.add_argument("--weight-deltas", action="store_true",
                       help="send across nodes only the weights' change since the copy each node holds (two-hop "
                            "shape, its own backward copy; not with --qwz, --hpz, --two-hop-gather)")
    group.add_argument("--weight-delta-bits", type=int, default=3, choices=DELTA_BIT_WIDTHS,
                       help="bits per value of the weight changes sent across nodes")
    group.add_argument("--hpz", type=positive_int, default=1,
                       help="hpZ secondary partition size in ranks (1 = off; must divide the ranks per node)")
    group.add_argument("--qgz", action="store_true", help="qgZ: quantized two-hop gradient reduce-scatter")
    group.add_argument("--gradient-bits", type=gradient_bit_pair, default="4,4", metavar="INTRA,INTER",
                       help=f"qgZ bits of the intra-node and the inter-node hop, each one of {list(BIT_WIDTHS)}")
    group.add_argument("--gradient-grid", default="uniform", choices=GRADIENT_GRIDS,
                       help="qgZ inter-node levels: uniform INT codes, or log (4 bits on powers of two)")
    group.add_argument("--gradient-scale-dtype", default="fp32", choices=GRADIENT_SCALE_DTYPES,
                       help="qgZ block scales on the wire: fp32, or bf16 (half the scale bytes)")
    group.add_argument("--gradient-chunks", type=positive_int, default=2, help="qgZ pipeline chunks per unit")
    group.add_argument("--block-size", type=positive_int, default=256,
                       help="values per quantization block (one fp32 scale each; an even number)")
    group.add_argument("--late-bits-from-step", type=non_negative_int, default=0,
                       help="from this step on use --late-weight-bits and --late-gradient-bits (0: never)")
    group.add_argument("--late-weight-bits", type=int, default=12, choices=BIT_WIDTHS,
                       help="qwZ bits per weight from --late-bits-from-step on")
    group.add_argument("--late-gradient-bits", type=int, default=4, choices=BIT_WIDTHS,
                       help="qgZ inter-node bits from --late-bits-from-step on")
    group.add_argument("--compile-quantization", action="store_true",
                       help="quantize through torch.compile where the native CPU kernels do not apply")
    group.add_argument("--prefetch-units", type=positive_int, default=1,
                       help="units ahead whose weight gathers are in flight while one computes")


def _add_checkpoints(group) -> None:
    group.add_argument("--checkpoint-dir", default=None, metavar="FOLDER",
                       help="save sharded checkpoints here (default: no checkpoints)")
    group.add_argument("--checkpoint-every", type=non_negative_int, default=0,
                       help="steps between checkpoints (0: only at the end)")
    group.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")


def _add_launch(group) -> None:
    group.add_argument("--world-size", type=positive_int, default=4, help="CPU ranks to start (ignored under torchrun)")
    group.add_argument("--ranks-per-node", type=positive_int, default=None,
                       help="ranks per (emulated) node (default: LOCAL_WORLD_SIZE under torchrun, else 2 "
                            "when the world size is even and 1 when odd)")
    group.add_argument("--timeout", type=positive_float, default=300.0, help="seconds a collective may wait for a peer")
    group.add_argument("--out", default="runs/train", metavar="FOLDER",
                       help="folder for metrics.jsonl and summary.json")
    group.add_argument("--record-schedule", default=None, metavar="FILE",
                       help="write rank 0's last step as a schedule (collectives, waits, unit compute) that "
                            "zeropp plan --schedule replays on other hardware")
