"""Saving and loading a ShardedModel with its ShardedOptimizer, one file per rank.

Each rank writes its fp32 master shards, the optimizer state of those shards and its RNG
state; rank 0 adds the metadata (structure, layout, config, step, per-file size and
sha256) and publishes the checkpoint by renaming its folder. Loading maps values by
parameter name, so the world size, node layout and padding may all differ from the save.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from .format import (
    FORMAT,
    LATEST,
    METADATA,
    CheckpointError,
    fsync_path,
    rank_file_name,
    read_metadata,
    resolve_checkpoint,
    sha256_of,
    step_folder_name,
    write_atomically,
)
from .resharding import RankFiles, assemble_shard, check_compatible, describe_flats


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    extra: dict
    same_layout: bool  # world size unchanged: RNG states were restored too


def save_checkpoint(model, optimizer, root: str | Path, step: int, extra: dict | None = None) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint folder."""
    staging = write_shards(model, optimizer, root, step, extra)
    return commit(model, staging, step)


def write_shards(model, optimizer, root, step: int, extra: dict | None) -> Path:
    """First half of a save: every rank's file and rank 0's metadata, in a hidden folder."""
    root = Path(root)
    rank, world = model.topology.rank, model.topology.world_size
    token = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)  # one staging folder for all ranks
    staging = root / f".tmp-{step_folder_name(step)}-{token[0]}"
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / rank_file_name(rank)
    tensors = _rank_tensors(model, optimizer)
    _check_space(root, staging, sum(t.numel() * t.element_size() for t in tensors.values()))
    failure = None
    try:
        save_file(tensors, str(path))
        fsync_path(path)
    except OSError as error:  # a full disk shows here on some ranks only: agree before going on
        failure = f"{path}: {error.strerror or error}"
    _agree_or_abort(staging, failure, "writing the rank files failed")
    files = [None] * world
    dist.all_gather_object(files, (path.name, path.stat().st_size, sha256_of(path)))
    if rank == 0:
        metadata = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "ranks_per_node": model.topology.ranks_per_node,
            "config": asdict(model.config),
            "flats": describe_flats(model.flat_params()),
            "optimizer": {
                "class": type(optimizer.optimizer).__name__,
                "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            },
            "files": {name: {"bytes": size, "sha256": digest} for name, size, digest in files},
            "extra": extra or {},
        }
        try:
            (staging / METADATA).write_text(json.dumps(metadata, indent=1, default=str))
            fsync_path(staging / METADATA)
        except OSError as error:
            failure = f"{staging / METADATA}: {error.strerror or error}"
    _agree_or_abort(staging, failure, "writing the metadata failed")
    return staging


# safetensors' header (names, shapes, offsets) per file, an upper bound for our few tensors.
HEADER_BYTES = 64 * 1024


def _check_space(root: Path, staging: Path, rank_bytes: int) -> None:
    """Collective: refuse before writing when the file system cannot hold the checkpoint
    (every rank's file; several ranks may share the file system)."""
    needed = [0] * dist.get_world_size()
    dist.all_gather_object(needed, rank_bytes + HEADER_BYTES)
    free = shutil.disk_usage(staging).free
    failure = None
    if sum(needed) > free:
        failure = (f"not enough space for the checkpoint at {root}: it needs {sum(needed):,} bytes "
                   f"({len(needed)} rank files), the file system has {free:,} free")
    _agree_or_abort(staging, failure, "not enough space")


def _agree_or_abort(staging: Path, failure: str | None, summary: str) -> None:
    """Collective: when any rank failed, every rank removes the staged folder and raises
    the same error, so no rank is left waiting in a collective."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    reasons = [reason for reason in failures if reason]
    if not reasons:
        return
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    raise CheckpointError(f"checkpoint not saved ({summary}); the previous one is untouched. " + "; ".join(dict.fromkeys(reasons)))


def commit(model, staging: Path, step: int) -> Path:
    """Second half: publish the staged folder and point ``latest`` at it."""
    final = staging.parent / step_folder_name(step)
    if model.topology.rank == 0:
        if final.exists():  # an older save of the same step: replace it only now, complete
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_path(final.parent)
        write_atomically(final.parent / LATEST, final.name + "\n")
        for leftover in final.parent.glob(".tmp-*"):  # saves that died before this point
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    return final


def _rank_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """What this rank's file holds, on CPU (the file format's side of any device)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    device = model.topology.device
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    for index, flat in enumerate(model.flat_params()):
        tensors[f"{index}.master"] = flat.master.detach().cpu().contiguous()
        for key, value in optimizer.optimizer.state.get(flat.master, {}).items():
            if torch.is_tensor(value):
                tensors[f"{index}.state.{key}"] = value.detach().cpu().contiguous()
        gather_state = model.weight_gather.saved_state(flat)
        if gather_state is not None:  # the delta gather's copies: without them a resume starts them afresh
            tensors[f"{index}.gather"] = gather_state.detach().cpu().contiguous()
    return tensors


def load_checkpoint(model, optimizer, path: str | Path) -> CheckpointInfo:
    """Collective. Loads master shards and optimizer state into this (possibly differently
    sharded) model; restores RNG states when the world size is unchanged."""
    folder = resolve_checkpoint(path)
    metadata = read_metadata(folder)
    check_compatible(metadata["flats"], model.flat_params())
    files = RankFiles(folder, metadata)
    rank = model.topology.rank
    saved_groups = metadata["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved_groups)} optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    if metadata["optimizer"]["class"] != type(optimizer.optimizer).__name__:
        raise CheckpointError(f"checkpoint optimizer is {metadata['optimizer']['class']}, this one {type(optimizer.optimizer).__name__}")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in saved.items()})
    name_to_saved = {flat["name"]: index for index, flat in enumerate(metadata["flats"])}
    state_keys = {key.split(".", 2)[2] for key in files.keys(0) if ".state." in key}
    with torch.no_grad():
        for flat in model.flat_params():
            flat.master.copy_(assemble_shard(flat, rank, metadata["flats"], files, "master"))
            if flat.requires_grad:
                optimizer.optimizer.state[flat.master] = _optimizer_state(
                    flat, rank, metadata, files, state_keys, name_to_saved.get(flat.name, 0)
                )
    same_layout = metadata["world_size"] == model.topology.world_size
    if same_layout:
        torch.set_rng_state(files.read(rank, "rng.torch"))
        if model.topology.device.type == "cuda" and "rng.cuda" in files.keys(rank):
            torch.cuda.set_rng_state(files.read(rank, "rng.cuda"), model.topology.device)
    model.on_weights_changed(include_frozen=True)
    if same_layout and metadata["ranks_per_node"] == model.topology.ranks_per_node:
        _load_gather_state(model, files, rank, name_to_saved)
    dist.barrier()
    return CheckpointInfo(folder, metadata["step"], metadata["extra"], same_layout)


def _load_gather_state(model, files, rank: int, name_to_saved: dict[str, int]) -> None:
    """The weight gather's copies, where saved for the same shard (same layout and padding).
    Every rank decides alike: the keys and shapes follow from the layout and config."""
    for flat in model.flat_params():
        key = f"{name_to_saved.get(flat.name)}.gather"
        if key in files.keys(rank):
            state = files.read(rank, key)
            if state.shape[-1] == flat.shard_numel:
                model.weight_gather.load_saved_state(flat, state)


def _optimizer_state(flat, rank, metadata, files, state_keys, saved_index) -> dict:
    state = {}
    for key in sorted(state_keys):
        saved_key = f"{saved_index}.state.{key}"
        if saved_key in files.keys(0) and files.read(0, saved_key).dim() == 0:
            state[key] = files.read(0, saved_key).clone()  # a scalar such as Adam's step (CPU, as torch keeps it)
        else:
            state[key] = assemble_shard(flat, rank, metadata["flats"], files, f"state.{key}").to(flat.master.device)
    return state
