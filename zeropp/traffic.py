"""Bytes one rank receives from one collective, intra and inter node: the arithmetic every
strategy's ``predicted_bytes`` is written in (docs/design.md section 7).

Counted like :class:`CommLog`: an all-to-all brings one chunk from every other member; an
all-gather is a ring, which brings the other G - 1 chunks from this rank's predecessor in
the group; a sender on another node makes the bytes inter-node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .topology import Layout


@dataclass(frozen=True)
class Traffic:
    """Bytes received by one rank."""

    intra_node: float = 0.0
    inter_node: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.intra_node + other.intra_node, self.inter_node + other.inter_node)

    def as_row(self) -> dict[str, int]:
        return {"received_intra_node": round(self.intra_node), "received_inter_node": round(self.inter_node)}


NONE = Traffic()


def ring(layout: Layout, rank: int, group: Sequence[int], chunk_bytes: float) -> Traffic:
    """A ring all-gather (or reduce-scatter) over ``group``, ``rank`` a member: G - 1 chunks
    from the predecessor."""
    if len(group) == 1:
        return NONE
    predecessor = group[(list(group).index(rank) - 1) % len(group)]
    total = (len(group) - 1) * chunk_bytes
    return Traffic(inter_node=total) if not layout.same_node(predecessor, rank) else Traffic(intra_node=total)


def exchange(layout: Layout, rank: int, group: Sequence[int], chunk_bytes: float) -> Traffic:
    """An all-to-all over ``group``: one chunk from every other member."""
    remote = sum(1 for peer in group if peer != rank and not layout.same_node(peer, rank))
    local = len(group) - 1 - remote
    return Traffic(local * chunk_bytes, remote * chunk_bytes)


def world(layout: Layout) -> list[int]:
    return list(range(layout.world_size))


def intra_node(layout: Layout, rank: int) -> list[int]:
    return layout.intra_node_ranks(layout.node_of(rank))


def inter_node(layout: Layout, rank: int) -> list[int]:
    return layout.inter_node_ranks(layout.local_index_of(rank))
