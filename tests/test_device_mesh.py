"""A 2-D DeviceMesh (FSDP2's replicate x shard) is accepted as the topology and trains
exactly like the same layout given by ranks_per_node."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig

CONFIG = ZeroConfig(quantized_weights=True, hpz_size=2, quantized_gradients=True, quantization_block_size=64)


def losses(topology, rank):
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, CONFIG, unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=3e-3))
    result = []
    for step in range(3):
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        result.append(loss.item())
    return result


def both_ways(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    from_mesh = Topology.from_device_mesh(mesh)
    layout = (from_mesh.num_nodes, from_mesh.ranks_per_node, str(from_mesh.device))
    return layout, losses(from_mesh, rank), losses(Topology.from_environment(ranks_per_node=2), rank)


def test_device_mesh_gives_the_same_layout_and_losses():
    for layout, from_mesh, from_ranks_per_node in spawn_ranks(both_ways, 4):
        assert layout == (2, 2, "cpu")
        assert from_mesh == from_ranks_per_node


def one_dimensional(rank, world_size):
    Topology.from_device_mesh(init_device_mesh("cpu", (4,)))


def test_a_one_dimensional_mesh_is_refused():
    with pytest.raises(ValueError, match="has 1 dimensions; give a 2-D mesh"):
        spawn_ranks(one_dimensional, 4)
