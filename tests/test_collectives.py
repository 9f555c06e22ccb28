"""The engine's collectives against slow references built from plain collectives."""

import pytest
import torch

from zeropp import Topology
from zeropp.accounting import CommLog
from zeropp.collectives import Communicator
from zeropp.collectives.reference import reference_all_gather, reference_reduce_scatter_mean
from zeropp.launch import spawn_ranks


def compare(rank, world_size):
    topology = Topology.from_environment(ranks_per_node=2)
    communicator = Communicator(CommLog(topology.layout, rank))
    results = []
    for group_name in ("world", "intra_node", "inter_node"):
        group = topology.group(group_name)
        member = group.ranks.index(rank)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            generator = torch.Generator().manual_seed(rank * 31 + 7)
            shard = torch.randn(13, generator=generator).to(dtype)
            gathered = torch.empty(13 * group.size, dtype=dtype)
            work = communicator.all_gather(gathered, shard, group, "test")
            work.wait()
            assert torch.equal(gathered, reference_all_gather(shard, group)), (group_name, dtype)

            flat = torch.randn(group.size * 11, generator=generator).to(dtype)
            mine = communicator.reduce_scatter_mean(flat, group, "test").wait()
            reference = reference_reduce_scatter_mean(flat, group, member)
            results.append((group_name, str(dtype), (mine - reference).abs().max().item()))
    return results


def test_collectives_match_references():
    for rank_results in spawn_ranks(compare, 4):
        for group_name, dtype, error in rank_results:
            # Summation in fp32 of values already in the input dtype: only fp32 rounding.
            assert error < 1e-6, (group_name, dtype, error)


def collective_on_the_wrong_device(rank, world_size):
    topology = Topology.from_environment(ranks_per_node=1)
    assert topology.device == torch.device("cpu")  # no GPU in the CPU suite
    communicator = Communicator(CommLog(topology.layout, rank), device=topology.device)
    shard = torch.ones(4, device="meta")
    communicator.all_gather(torch.empty(8, device="meta"), shard, topology.group("world"), "test")


def test_every_collective_checks_the_topology_device():
    with pytest.raises(ValueError, match=r"the tensor is on meta, the topology's device is cpu"):
        spawn_ranks(collective_on_the_wrong_device, 2)
