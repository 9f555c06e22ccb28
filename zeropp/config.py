"""Configuration of the sharded engine: one frozen object, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_dtype(field_name: str, value: str | torch.dtype) -> torch.dtype:
    """Turn ``"bf16"`` or ``torch.bfloat16`` into a dtype, naming the field on error."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"{field_name}={value!r} is not supported; allowed values: {sorted(DTYPES)}")


@dataclass(frozen=True)
class ZeroConfig:
    """How a model is sharded and communicated. Every field has a safe default."""

    compute_dtype: str = "fp32"
    """Dtype of gathered weights and of forward/backward compute ("fp32", "bf16", "fp16")."""
    reduce_dtype: str | None = None
    """Dtype gradients are communicated in; None means the compute dtype."""
    prefetch: bool = True
    """Gather the next unit asynchronously while the current one computes."""
    reshard_root_after_forward: bool = False
    """Free the root unit after forward; False keeps it for backward, which needs it first."""
    sync_module_states: bool = True
    """Broadcast rank 0's initial weights so every rank starts from the same model."""
    activation_checkpointing: bool = False
    """Recompute each unit's activations in backward instead of storing them."""
    shard_alignment: int = 1
    """Each rank's shard length is a multiple of this many elements (quantization blocks)."""

    def __post_init__(self) -> None:
        parse_dtype("compute_dtype", self.compute_dtype)
        if self.reduce_dtype is not None:
            parse_dtype("reduce_dtype", self.reduce_dtype)
        for item in fields(self):
            value = getattr(self, item.name)
            if item.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{item.name} must be true or false, got {value!r}")
        if not isinstance(self.shard_alignment, int) or self.shard_alignment < 1:
            raise ValueError(f"shard_alignment must be a positive integer, got {self.shard_alignment!r}")

    @property
    def compute_torch_dtype(self) -> torch.dtype:
        return parse_dtype("compute_dtype", self.compute_dtype)

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        if self.reduce_dtype is None:
            return self.compute_torch_dtype
        return parse_dtype("reduce_dtype", self.reduce_dtype)
