"""On-disk layout of a checkpoint, and the checks that make a bad one fail clearly.

    ROOT/
      latest                      name of the newest complete checkpoint (replaced atomically)
      step_00000100/
        metadata.json             structure, layout, config, step, files with size and sha256
        rank00000.safetensors     rank 0's master shards, optimizer state, RNG state
        ...
      .tmp-step_00000200-<token>/ a save in progress (or killed): never read, removed later

A checkpoint becomes visible only by renaming its finished folder, so a crash at any point
leaves the previous checkpoint in place and ``latest`` pointing at it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT = "zeropp-checkpoint-1"
LATEST = "latest"
METADATA = "metadata.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupted or incompatible."""


def step_folder_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never half."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    fsync_path(temporary)
    os.replace(temporary, path)
    fsync_path(path.parent)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a root whose ``latest`` names one."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        folder = path / latest.read_text().strip()
        if not (folder / METADATA).is_file():
            raise CheckpointError(f"{latest} names {folder.name}, which has no {METADATA}; the checkpoint is incomplete")
        return folder
    raise CheckpointError(f"no checkpoint at {path}: neither {path / METADATA} nor {path / LATEST} exists")


def read_metadata(folder: Path) -> dict:
    try:
        metadata = json.loads((folder / METADATA).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{folder / METADATA} cannot be read: {error}") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{folder / METADATA}: format {metadata.get('format')!r} is not {FORMAT!r}")
    return metadata


def verify_file(folder: Path, name: str, metadata: dict, checksum: bool = True) -> Path:
    """The file exists with the recorded size (and sha256); else a CheckpointError naming it."""
    path = folder / name
    expected = metadata["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path} is not listed in {METADATA}")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
    size = path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, {expected['bytes']} were written: the file is truncated or replaced")
    if checksum and sha256_of(path) != expected["sha256"]:
        raise CheckpointError(f"{path}: sha256 does not match the one recorded at save time; the file is corrupted")
    return path
