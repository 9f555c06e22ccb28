"""Reading a DeepSpeed-style JSON config into our :class:`ZeroConfig`.

Accepted keys are mapped; ``"auto"`` (as Hugging Face writes them) means "your default";
DeepSpeed's tuning hints (bucket sizes, prefetch limits, logging) are ignored with a
warning, as zeropp sizes those itself; any other key changes what training computes and is
an error that names it::

    {"zero_optimization": {"stage": 3, "zero_quantized_weights": true,
                           "zero_hpz_partition_size": 2, "zero_quantized_gradients": true,
                           "overlap_comm": true},
     "bf16": {"enabled": true} | "fp16": {"enabled": true},
     "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
     "gradient_clipping": 1.0}
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .config import ZeroConfig

ZERO_KEYS = {
    "stage": None,
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_size",
    "zero_quantized_gradients": "quantized_gradients",
    "zero_quantized_nontrainable_weights": "quantized_nontrainable_weights",
    "overlap_comm": "prefetch",
}
TRAINING_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
PRECISION_KEYS = ("bf16", "fp16")
# Keys that only tune how DeepSpeed schedules its work: the result of training is the same.
TUNING_HINTS = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "zero_allow_untested_optimizer", "memory_breakdown",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
}
ZERO_TUNING_HINTS = {
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "contiguous_gradients", "sub_group_size",
    "round_robin_gradients", "reduce_scatter", "allgather_partitions", "zero_hpz_partition_size_auto",
    "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
}
AUTO = "auto"
logger = logging.getLogger(__name__)


def load_deepspeed_config(source: dict | str | Path) -> tuple[ZeroConfig, dict]:
    """Returns our config and the training settings found (batch, accumulation, clipping)."""
    if not isinstance(source, dict):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"DeepSpeed config {path} does not exist (or is not a file)")
        try:
            source = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from None
    source = _without_hints(_without_auto(source), TUNING_HINTS, "")
    unknown = sorted(set(source) - {"zero_optimization", *PRECISION_KEYS, *TRAINING_KEYS})
    if unknown:
        raise ValueError(
            f"unsupported DeepSpeed config keys: {unknown}; supported: "
            f"{sorted(['zero_optimization', *PRECISION_KEYS, *TRAINING_KEYS])}"
        )
    fields = _zero_fields(source.get("zero_optimization", {}))
    fields.update(_precision_fields(source))
    training = {key: source[key] for key in TRAINING_KEYS if key in source}
    return ZeroConfig(**fields), training


def zero_config_from(source: ZeroConfig | dict | str | Path | None) -> ZeroConfig:
    """A ``ZeroConfig`` as given, or mapped from a DeepSpeed JSON (its unknown keys refused by name)."""
    if source is None:
        return ZeroConfig()
    if isinstance(source, ZeroConfig):
        return source
    if isinstance(source, (dict, str, Path)):
        return load_deepspeed_config(source)[0]
    raise ValueError("zero_config must be a ZeroConfig, a DeepSpeed JSON path or dict, or None; "
                     f"got {type(source).__name__}")


def _zero_fields(zero: dict) -> dict:
    if not isinstance(zero, dict):
        raise ValueError("zero_optimization must be an object")
    zero = _without_hints(_without_auto(zero), ZERO_TUNING_HINTS, "zero_optimization.")
    unknown = sorted(set(zero) - set(ZERO_KEYS))
    if unknown:
        raise ValueError(f"unsupported zero_optimization keys: {unknown}; supported: {sorted(ZERO_KEYS)}")
    if zero.get("stage", 3) != 3:
        raise ValueError(f"zero_optimization.stage={zero['stage']!r}: zeropp implements stage 3 only")
    fields = {ours: zero[theirs] for theirs, ours in ZERO_KEYS.items() if ours and theirs in zero}
    if "hpz_size" in fields and (not isinstance(fields["hpz_size"], int) or fields["hpz_size"] < 1):
        raise ValueError(f"zero_optimization.zero_hpz_partition_size must be an integer >= 1, got {fields['hpz_size']!r}")
    return fields


def _precision_fields(source: dict) -> dict:
    enabled = []
    for key in PRECISION_KEYS:
        section = source.get(key, {})
        if isinstance(section, dict):
            section = _without_auto(section)
        if not isinstance(section, dict) or set(section) - {"enabled"}:
            raise ValueError(f"{key} must be an object with only 'enabled', got {section!r}")
        if section.get("enabled", False):
            enabled.append(key)
    if len(enabled) > 1:
        raise ValueError("bf16.enabled and fp16.enabled are both true; choose one")
    return {"compute_dtype": enabled[0]} if enabled else {}


def _without_auto(section: dict) -> dict:
    """``"auto"`` leaves the choice to us: the key is dropped and our default applies."""
    kept = {key: value for key, value in section.items() if value != AUTO}
    for key in sorted(set(section) - set(kept)):
        logger.info("DeepSpeed config: %s is \"auto\": zeropp's default applies", key)
    return kept


def _without_hints(section: dict, hints: set[str], prefix: str) -> dict:
    ignored = sorted(set(section) & hints)
    if ignored:
        logger.warning("DeepSpeed config: ignoring tuning hints %s (zeropp does not use them; results are unchanged)",
                       [prefix + key for key in ignored])
    return {key: value for key, value in section.items() if key not in hints}
