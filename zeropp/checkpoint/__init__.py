"""Sharded checkpoints: atomic saves, resume, re-sharding on load, consolidated export."""

from .distributed import DistributedState, load_optimizer_state_dict, optimizer_state_dict
from .export import export_consolidated, export_model
from .format import CheckpointError, resolve_checkpoint
from .sharded import CheckpointInfo, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "DistributedState",
    "export_consolidated",
    "export_model",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
    "resolve_checkpoint",
    "save_checkpoint",
]
