"""The data-parallel world as N nodes x D ranks per node, and its process groups.

Rank ``r = n * D + d`` lives on node ``n`` with local index ``d`` (docs/design.md section 1).
The node size is a property of this object, not of the machine, so four processes on one
machine can act as two nodes of two ranks each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Pure arithmetic of a world of ``world_size`` ranks split into nodes."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.world_size % self.ranks_per_node != 0:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} does not divide world_size="
                f"{self.world_size}; allowed values: {divisors}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def intra_node_ranks(self, node: int) -> list[int]:
        first = node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def inter_node_ranks(self, local_index: int) -> list[int]:
        return [n * self.ranks_per_node + local_index for n in range(self.num_nodes)]

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        return self.node_of(rank_a) == self.node_of(rank_b)


@dataclass(frozen=True)
class Group:
    """A process group together with the global ranks it contains, in group order."""

    name: str
    ranks: tuple[int, ...]
    handle: object = field(repr=False, compare=False)
    # A side group's collectives start when their data arrives: their order against the
    # main groups' differs between ranks by design (see Topology.side_group).
    launched_on_arrival: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)


class Topology:
    """This rank's view of the layout plus the world, intra-node and inter-node groups.

    Build it once with :meth:`from_environment` after ``init_process_group`` and pass it
    explicitly to whatever communicates; there are no module-level group globals.
    """

    def __init__(self, layout: Layout, rank: int, groups: dict[str, Group], timeout_s: float | None = None,
                 device: torch.device | str = "cpu", device_map: list[torch.device] | None = None) -> None:
        assert 0 <= rank < layout.world_size
        assert device_map is None or len(device_map) == layout.world_size
        self.layout = layout
        self.rank = rank
        self.device = torch.device(device)  # where this rank's shards, buffers and collectives live
        # Every rank's device, as each rank chose it (not derived from the layout: four
        # emulated nodes' ranks may share one GPU); None means each is on ``device``'s kind.
        self._device_map = device_map
        self._groups = groups
        self._timeout = None if timeout_s is None else timedelta(seconds=timeout_s)

    @classmethod
    def from_environment(cls, ranks_per_node: int | None = None, timeout_s: float | None = None,
                         device: torch.device | str | None = None) -> "Topology":
        """Create the groups for the current process group world.

        ``ranks_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE`` (or the whole world
        when that is unset). Every rank must call this collectively, with the same value.
        ``timeout_s`` bounds every collective on the groups created here (a crashed or hung
        peer then ends in an error instead of a hang); give ``init_process_group`` the same.
        ``device`` defaults to ``cuda:LOCAL_RANK`` when the process group has NCCL (see
        ``zeropp.launch.init_from_torchrun``), else the CPU.
        """
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized; call init_process_group first")
        world_size = dist.get_world_size()
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        layout = Layout(world_size, ranks_per_node)
        rank = dist.get_rank()
        groups = {"world": Group("world", tuple(range(world_size)), dist.group.WORLD)}
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        groups["intra_node"] = _own_group("intra_node", _intra_node_partition(layout), rank, timeout)
        groups["inter_node"] = _own_group("inter_node", _inter_node_partition(layout), rank, timeout)
        if device is None:  # the GPU when the process group can move CUDA tensors with NCCL
            on_gpu = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if on_gpu else "cpu"
        return cls(layout, rank, groups, timeout_s, device, _gather_device_map(torch.device(device), world_size))

    @classmethod
    def from_device_mesh(cls, mesh, timeout_s: float | None = None) -> "Topology":
        """A 2-D ``DeviceMesh`` of nodes x ranks per node, such as FSDP2's (replicate, shard)
        mesh built by ``init_device_mesh(device, (N, D))``: dim 0 runs across nodes, dim 1
        inside a node. Collective, like :meth:`from_environment`."""
        if mesh.ndim != 2:
            raise ValueError(f"the device mesh has {mesh.ndim} dimensions; give a 2-D mesh (nodes, ranks per node)")
        nodes, per_node = mesh.shape
        ranks = mesh.mesh.flatten().tolist()
        if ranks != list(range(nodes * per_node)) or nodes * per_node != dist.get_world_size():
            raise ValueError(f"the device mesh must hold ranks 0..W-1 in order (rank = node * D + local index) over "
                             f"the whole world of {dist.get_world_size()}; it holds {ranks}")
        device = "cpu" if mesh.device_type == "cpu" else f"{mesh.device_type}:{int(os.environ.get('LOCAL_RANK', 0))}"
        return cls.from_environment(ranks_per_node=per_node, timeout_s=timeout_s, device=device)

    def device_of(self, rank: int) -> torch.device:
        """The device global rank ``rank`` keeps its shards on."""
        if self._device_map is None:
            return torch.device(self.device.type)
        return self._device_map[rank]

    def hpz_group(self, hpz_size: int) -> Group:
        """The group of ``hpz_size`` consecutive ranks inside this rank's node that share a
        secondary partition (hpZ). Collective on first use for a size: every rank must ask."""
        name = f"hpz_{hpz_size}"
        if name not in self._groups:
            # ZeroConfig.check_layout told the user already; here it is an invariant.
            assert hpz_size >= 1 and self.ranks_per_node % hpz_size == 0, (hpz_size, self.ranks_per_node)
            if hpz_size == 1:  # every rank its own secondary: nothing to communicate
                self._groups[name] = Group(name, (self.rank,), None)
            else:
                partition = [list(range(first, first + hpz_size)) for first in range(0, self.world_size, hpz_size)]
                self._groups[name] = _own_group(name, partition, self.rank, self._timeout)
        return self._groups[name]

    def side_group(self, of: str, purpose: str) -> Group:
        """A second communicator over the ranks of this rank's ``of`` group ("intra_node" or
        "inter_node"), for collectives launched when data arrives rather than at a fixed
        point of the program: their order can differ between ranks relative to the main
        group's, never among themselves. Collective on first use: every rank must ask."""
        partitions = {"intra_node": _intra_node_partition, "inter_node": _inter_node_partition}
        if of not in partitions:
            raise ValueError(f"side groups exist for {sorted(partitions)}, not {of!r}")
        name = f"{of}:{purpose}"
        if name not in self._groups:
            own = _own_group(name, partitions[of](self.layout), self.rank, self._timeout)
            self._groups[name] = replace(own, launched_on_arrival=True)
        return self._groups[name]

    def group(self, name: str) -> Group:
        if name not in self._groups:
            raise ValueError(f"unknown group {name!r}; known: {sorted(self._groups)}")
        return self._groups[name]

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.layout.ranks_per_node

    @property
    def node(self) -> int:
        return self.layout.node_of(self.rank)

    @property
    def local_index(self) -> int:
        return self.layout.local_index_of(self.rank)

    def __repr__(self) -> str:
        return (
            f"Topology(rank={self.rank}, world_size={self.world_size}, "
            f"num_nodes={self.num_nodes}, ranks_per_node={self.ranks_per_node}, device={self.device})"
        )


def _gather_device_map(device: torch.device, world_size: int) -> list[torch.device] | None:
    """Collective for accelerator devices: every rank's device, as each rank reports it."""
    if device.type == "cpu":
        return None
    if world_size == 1 or dist.get_backend() == "fake":  # a dry run: one process stands for every rank
        return [device] * world_size
    devices: list = [None] * world_size
    dist.all_gather_object(devices, str(device))
    return [torch.device(name) for name in devices]


def _intra_node_partition(layout: Layout) -> list[list[int]]:
    return [layout.intra_node_ranks(node) for node in range(layout.num_nodes)]


def _inter_node_partition(layout: Layout) -> list[list[int]]:
    return [layout.inter_node_ranks(local_index) for local_index in range(layout.ranks_per_node)]


def _own_group(name: str, partition: list[list[int]], rank: int, timeout) -> Group:
    """Create one process group per rank list of ``partition``; return this rank's.
    new_group is collective over the whole world: every rank creates every group."""
    own = None
    for ranks in partition:
        handle = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            own = Group(name, tuple(ranks), handle)
    assert own is not None, (name, rank, partition)
    return own
