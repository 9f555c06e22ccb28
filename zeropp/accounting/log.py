"""Accounting of every collective: what this rank sent and received, inside and across nodes.

Bytes are counted as the backend's algorithm moves them. An all-to-all sends chunk ``j``
straight to member ``j``. An all-gather is a ring (gloo's and NCCL's algorithm; measured on
an emulated cluster: each node's link carried 3 of 4 shards per gather on 2 nodes x 2):
every member receives the other G-1 chunks from its predecessor and forwards them to its
successor. A peer on another node (per the topology) makes those bytes inter-node.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..topology import Layout


@dataclass(frozen=True)
class CollectiveRecord:
    op: str
    group: str
    phase: str
    sent_intra_node: int
    sent_inter_node: int
    received_intra_node: int
    received_inter_node: int

    @property
    def sent(self) -> int:
        return self.sent_intra_node + self.sent_inter_node

    @property
    def received(self) -> int:
        return self.received_intra_node + self.received_inter_node


class CommLog:
    """Collects :class:`CollectiveRecord` entries for one rank; reset once per step."""

    def __init__(self, layout: Layout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.records: list[CollectiveRecord] = []
        self.lifetime: dict[str, int] = defaultdict(int)  # every record since creation, not reset

    def record_exchange(
        self, op: str, group_ranks: tuple[int, ...], phase: str, chunk_bytes: int
    ) -> None:
        """Record a collective in which this rank exchanges ``chunk_bytes`` with every other
        member in each direction (all-gather, all-to-all with equal splits, broadcast-free
        exchanges)."""
        peers = [peer for peer in group_ranks if peer != self.rank]
        intra = sum(1 for peer in peers if self.layout.same_node(peer, self.rank))
        inter = len(peers) - intra
        self.record(
            CollectiveRecord(
                op=op,
                group=_group_label(group_ranks, self.layout),
                phase=phase,
                sent_intra_node=intra * chunk_bytes,
                sent_inter_node=inter * chunk_bytes,
                received_intra_node=intra * chunk_bytes,
                received_inter_node=inter * chunk_bytes,
            )
        )

    def record_ring(self, op: str, group_ranks: tuple[int, ...], phase: str, chunk_bytes: int) -> None:
        """Record a ring collective: G-1 chunks from the predecessor, G-1 to the successor."""
        size = len(group_ranks)
        position = group_ranks.index(self.rank)
        predecessor, successor = group_ranks[position - 1], group_ranks[(position + 1) % size]
        moved = (size - 1) * chunk_bytes
        received_remote = size > 1 and not self.layout.same_node(predecessor, self.rank)
        sent_remote = size > 1 and not self.layout.same_node(successor, self.rank)
        self.record(
            CollectiveRecord(
                op=op,
                group=_group_label(group_ranks, self.layout),
                phase=phase,
                sent_intra_node=0 if sent_remote else moved,
                sent_inter_node=moved if sent_remote else 0,
                received_intra_node=0 if received_remote else moved,
                received_inter_node=moved if received_remote else 0,
            )
        )

    def record(self, record: CollectiveRecord) -> None:
        self.records.append(record)
        for key in ("sent_intra_node", "sent_inter_node", "received_intra_node", "received_inter_node"):
            self.lifetime[key] += getattr(record, key)

    def reset(self) -> None:
        self.records.clear()

    def totals_by_phase(self) -> dict[str, dict[str, int]]:
        """Bytes per phase: ``{phase: {"count", "sent", "received", "received_intra_node",
        "received_inter_node", "sent_inter_node"}}``."""
        totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for rec in self.records:
            row = totals[rec.phase]
            row["count"] += 1
            row["sent"] += rec.sent
            row["received"] += rec.received
            row["sent_intra_node"] += rec.sent_intra_node
            row["sent_inter_node"] += rec.sent_inter_node
            row["received_intra_node"] += rec.received_intra_node
            row["received_inter_node"] += rec.received_inter_node
        return {phase: dict(row) for phase, row in totals.items()}

    def totals(self) -> dict[str, int]:
        """Sum over all phases."""
        summed: dict[str, int] = defaultdict(int)
        for row in self.totals_by_phase().values():
            for key, value in row.items():
                summed[key] += value
        return dict(summed)


def _group_label(group_ranks: tuple[int, ...], layout: Layout) -> str:
    if len(group_ranks) == layout.world_size:
        return "world"
    nodes = {layout.node_of(rank) for rank in group_ranks}
    return "intra_node" if len(nodes) == 1 else "inter_node"


def format_table(totals_by_phase: dict[str, dict[str, int]]) -> str:
    """A fixed-width table of per-step bytes, one row per phase plus a total."""
    header = f"{'phase':<18}{'calls':>7}{'sent MB':>12}{'recv MB':>12}{'intra MB':>12}{'inter MB':>12}"
    lines = [header, "-" * len(header)]
    keys = ("count", "sent", "received", "received_intra_node", "received_inter_node")
    summed = dict.fromkeys(keys, 0)
    for phase in sorted(totals_by_phase):
        row = totals_by_phase[phase]
        for key in keys:
            summed[key] += row.get(key, 0)
        lines.append(_format_row(phase, row))
    lines.append(_format_row("total", summed))
    return "\n".join(lines)


def _format_row(label: str, row: dict[str, int]) -> str:
    mb = 1e6
    return (
        f"{label:<18}{row.get('count', 0):>7}{row.get('sent', 0) / mb:>12.3f}"
        f"{row.get('received', 0) / mb:>12.3f}{row.get('received_intra_node', 0) / mb:>12.3f}"
        f"{row.get('received_inter_node', 0) / mb:>12.3f}"
    )

