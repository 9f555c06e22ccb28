"""Sharded checkpoints: atomic saves, resume, re-sharding on load, consolidated export."""

from .export import export_consolidated
from .format import CheckpointError, resolve_checkpoint
from .sharded import CheckpointInfo, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "export_consolidated",
    "load_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
]
