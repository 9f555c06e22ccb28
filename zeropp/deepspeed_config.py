"""Reading a DeepSpeed-style JSON config into our :class:`ZeroConfig`.

Accepted (anything else is an error that names the key)::

    {"zero_optimization": {"stage": 3, "zero_quantized_weights": true,
                           "zero_hpz_partition_size": 2, "zero_quantized_gradients": true,
                           "overlap_comm": true},
     "bf16": {"enabled": true} | "fp16": {"enabled": true},
     "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
     "gradient_clipping": 1.0}
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ZeroConfig

ZERO_KEYS = {
    "stage": None,
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_size",
    "zero_quantized_gradients": "quantized_gradients",
    "overlap_comm": "prefetch",
}
TRAINING_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
PRECISION_KEYS = ("bf16", "fp16")


def load_deepspeed_config(source: dict | str | Path) -> tuple[ZeroConfig, dict]:
    """Returns our config and the training settings found (batch, accumulation, clipping)."""
    if not isinstance(source, dict):
        try:
            source = json.loads(Path(source).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not valid JSON ({error})") from None
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


def _zero_fields(zero: dict) -> dict:
    if not isinstance(zero, dict):
        raise ValueError("zero_optimization must be an object")
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
        if not isinstance(section, dict) or set(section) - {"enabled"}:
            raise ValueError(f"{key} must be an object with only 'enabled', got {section!r}")
        if section.get("enabled", False):
            enabled.append(key)
    if len(enabled) > 1:
        raise ValueError("bf16.enabled and fp16.enabled are both true; choose one")
    return {"compute_dtype": enabled[0]} if enabled else {}
