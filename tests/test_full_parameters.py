"""model.full_parameters(): whole parameters for reading and editing, written back."""

import pytest
import torch

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig


def build():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


def edit(model):
    model.ln_final.weight.fill_(2.0)
    model.blocks[0].attn.qkv.weight.mul_(0.5)


def read_and_edit(rank, world_size, rank0_only, options):
    topology = Topology.from_environment(ranks_per_node=2)
    model = ShardedModel(build(), topology, ZeroConfig(**options), unit_classes=(Block,))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:])  # gathered copies (and hpZ/qwZ caches) exist before
    with model.full_parameters(rank0_only=rank0_only):
        names = sorted(name for name, _ in model.module.named_parameters())
        seen = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        if rank == 0 or not rank0_only:
            edit(model.module)
    with torch.no_grad():
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
    return names, seen, loss, sorted(model.module._parameters)


@pytest.mark.parametrize("rank0_only,options", [(False, {}), (True, dict(quantized_weights=True, hpz_size=2))])
def test_full_parameters_read_and_write_back(rank0_only, options):
    reference = build()
    expected = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with torch.no_grad():
        edit(reference)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    results = spawn_ranks(read_and_edit, 4, (rank0_only, options))
    for rank, (names, seen, loss, left) in enumerate(results):
        if rank == 0 or not rank0_only:
            assert names == sorted(expected)
            assert all(torch.equal(seen[name], expected[name]) for name in expected)
        else:
            assert names == []  # nothing held on the other ranks
        assert left == []  # the temporary parameters are gone again
    with torch.no_grad():
        want = reference(tokens[:, :-1], tokens[:, 1:]).item()
    losses = [loss for _, _, loss, _ in results]
    tolerance = 1e-6 if not options else 2e-2  # qwZ gathers INT8 weights
    assert all(abs(loss - want) <= tolerance * want for loss in losses), (losses, want)
