"""Bytes one rank receives per training step, predicted from the layout and the config.

Counted like :class:`CommLog`: an all-to-all brings one chunk from every other member; an
all-gather is a ring, which brings the other members' G-1 chunks from this rank's
predecessor in the group; a sender on another node makes the bytes inter-node. One step is
one forward, one backward and one optimizer step (no gradient accumulation): the forward
gathers from the primary shards (secondary shards were invalidated by the last step), the
backward gathers every unit but the root (kept after forward unless resharded) from the
secondary shards when hpZ is on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig
from ..topology import Layout


@dataclass(frozen=True)
class FlatSummary:
    is_root: bool
    requires_grad: bool
    shard_numel: int


def _zero() -> dict[str, int]:
    return {"received_intra_node": 0, "received_inter_node": 0}


def _add(row: dict[str, int], intra_peers: int, inter_peers: int, chunk_bytes: float) -> None:
    row["received_intra_node"] += round(intra_peers * chunk_bytes)
    row["received_inter_node"] += round(inter_peers * chunk_bytes)


def _add_ring(row: dict[str, int], layout: Layout, rank: int, group_first: int, group_size: int, chunk_bytes: float) -> None:
    """A ring all-gather over consecutive ranks [group_first, group_first + group_size)."""
    if group_size == 1:
        return
    predecessor = group_first + (rank - group_first - 1) % group_size
    remote = not layout.same_node(predecessor, rank)
    _add(row, 0 if remote else group_size - 1, group_size - 1 if remote else 0, chunk_bytes)


def _add_primary_gather(
    row: dict[str, int], layout: Layout, rank: int, config: ZeroConfig, exact_chunk: int, primary_chunk: int
) -> None:
    """One gather from the primary shards: a ring over the world, or the hierarchical
    gather's three hops (this node's shards exact; one shard from every other node across;
    those, from every local rank, inside the node)."""
    if not config.hierarchical_weight_gather:
        _add_ring(row, layout, rank, 0, layout.world_size, primary_chunk)
        return
    per_node, nodes = layout.ranks_per_node, layout.num_nodes
    _add(row, per_node - 1, 0, exact_chunk)
    _add(row, 0, nodes - 1, primary_chunk)
    _add(row, per_node - 1, 0, (nodes - 1) * primary_chunk)


def predicted_step_bytes(
    flats: list[FlatSummary], layout: Layout, config: ZeroConfig, rank: int, backend: str = "gloo"
) -> dict[str, dict[str, int]]:
    """``{phase: {"received_intra_node": bytes, "received_inter_node": bytes}}`` for ``rank``.
    On NCCL the plain reduce-scatter is NCCL's ring; on gloo an all-to-all."""
    world, per_node, nodes = layout.world_size, layout.ranks_per_node, layout.num_nodes
    hpz_first = rank // config.hpz_size * config.hpz_size
    compute = config.compute_torch_dtype.itemsize
    weights = config.weight_format
    result = {"forward_gather": _zero(), "backward_gather": _zero(), "reduce_scatter": _zero()}
    for flat in flats:
        shard = flat.shard_numel
        primary_chunk = weights.packed_nbytes(shard) if config.quantized_weights else shard * compute
        _add_primary_gather(result["forward_gather"], layout, rank, config, shard * compute, primary_chunk)
        if not flat.is_root or config.reshard_root_after_forward:
            if config.hpz_size > 1:
                # The secondary partition holds world / hpz_size shards' worth, packed only
                # when every gathered shard was.
                kept_chunk = shard * compute if config.hierarchical_weight_gather else primary_chunk
                secondary = kept_chunk * world // config.hpz_size
                _add_ring(result["backward_gather"], layout, rank, hpz_first, config.hpz_size, secondary)
            else:
                _add_primary_gather(result["backward_gather"], layout, rank, config, shard * compute, primary_chunk)
        if flat.requires_grad:
            row = result["reduce_scatter"]
            if config.quantized_gradients:
                intra, inter = config.gradient_formats
                if per_node > 1:
                    _add(row, per_node - 1, 0, intra.packed_nbytes(nodes * shard))
                if nodes > 1:
                    _add(row, 0, nodes - 1, inter.packed_nbytes(shard))
            elif backend == "nccl":
                _add_ring(row, layout, rank, 0, world, shard * config.reduce_torch_dtype.itemsize)
            else:
                _add(row, per_node - 1, world - per_node, shard * config.reduce_torch_dtype.itemsize)
    return result
