"""The hierarchical weight gather against a plain gather of the masters: this node's shards
exact, the other nodes' shards exactly what qwZ hands out, fewer bytes over each node's
link, and training identical to ZeRO-3 when nothing is quantized."""

import pytest
import torch
import torch.distributed as dist

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.launch import spawn_ranks
from zeropp.models import GPT, Block, GPTConfig
from zeropp.quantization import dequantize, quantize

BLOCK = 64


def expected_full(flat, topology, config) -> torch.Tensor:
    """The slow reference: gather every fp32 master shard, then quantize and restore the
    shards of the other nodes. [W * S] in the compute dtype."""
    masters = [torch.empty_like(flat.master.detach()) for _ in range(topology.world_size)]
    dist.all_gather(masters, flat.master.detach())
    rows = []
    for rank, master in enumerate(masters):
        remote = not topology.layout.same_node(rank, topology.rank)
        if remote and config.quantized_weights:
            master = dequantize(quantize(master, config.weight_format), config.weight_format, master.numel())
        rows.append(master)
    return torch.cat(rows).to(config.compute_torch_dtype)


def gather_against_reference(rank, world_size, ranks_per_node, options):
    topology = Topology.from_environment(ranks_per_node=ranks_per_node)
    torch.manual_seed(0)
    config = ZeroConfig(two_hop_weight_gather=True, quantization_block_size=BLOCK, **options)
    model = ShardedModel(GPT(GPTConfig.preset("tiny")), topology, config, unit_classes=(Block,))
    mismatches = []
    for unit in model.units:
        for source in ("primary", "secondary"):  # the second gather uses hpZ's copy when on
            model._gathering.ensure(unit, "forward_gather")
            for flat in unit.flats:
                if not torch.equal(flat.full_data, expected_full(flat, topology, config)):
                    mismatches.append((flat.name, source))
            model._gathering.free(unit)
    return mismatches


@pytest.mark.parametrize(
    "ranks_per_node,options",
    [
        (2, dict(quantized_weights=True)),
        (2, dict(quantized_weights=True, hpz_size=2)),
        (2, dict(quantized_weights=True, weight_bits=12, hpz_size=2)),
        (2, dict(quantized_weights=True, hpz_size=2, compute_dtype="bf16")),
        (1, dict(quantized_weights=True)),
        (2, dict(hpz_size=2, shard_alignment=BLOCK)),
    ],
)
def test_gathered_weights_equal_the_reference(ranks_per_node, options):
    for mismatches in spawn_ranks(gather_against_reference, 4, (ranks_per_node, options)):
        assert mismatches == []


def train_losses(rank, world_size, configs):
    topology = Topology.from_environment(ranks_per_node=2)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(rank))
    results = []
    for config in configs:
        torch.manual_seed(0)
        model = ShardedModel(GPT(GPTConfig.preset("tiny", block_size=32)), topology, config, unit_classes=(Block,))
        optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
        losses = []
        for _ in range(4):
            model.comm_log.reset()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append({"losses": losses, "measured": model.comm_log.totals_by_phase(),
                         "predicted": model.predicted_step_bytes()})
    return results


def test_unquantized_hierarchical_gather_trains_exactly_like_zero3_and_matches_the_accounting():
    configs = [
        ZeroConfig(),
        ZeroConfig(two_hop_weight_gather=True),
        ZeroConfig(two_hop_weight_gather=True, hpz_size=2),
        ZeroConfig(two_hop_weight_gather=True, quantized_weights=True, hpz_size=2, quantized_gradients=True,
                   gradient_bits_intra_node=8, gradient_bits_inter_node=8, quantization_block_size=BLOCK),
        ZeroConfig(quantized_weights=True, hpz_size=2, quantized_gradients=True, quantization_block_size=BLOCK),
    ]
    per_rank = spawn_ranks(train_losses, 4, (configs,))
    for result in per_rank:
        zero3, hierarchical, with_hpz = (run["losses"] for run in result[:3])
        assert hierarchical == zero3
        assert with_hpz == zero3
        for run in result:
            for phase, predicted in run["predicted"].items():
                for key, value in predicted.items():
                    assert run["measured"][phase][key] == value, (phase, key)

    def node_link(config_index, phase):  # what node 0's ranks receive from the other node
        return sum(per_rank[rank][config_index]["measured"][phase]["received_inter_node"] for rank in (0, 1))

    # 2 nodes x 2 ranks: the ring brings 3 of 4 shards over node 0's link, the hierarchical gather 2.
    assert node_link(1, "forward_gather") * 3 == node_link(0, "forward_gather") * 2
    # With INT8 gradients across nodes, the setting still moves no more bytes than ZeRO++.
    ours = sum(node_link(3, phase) for phase in ("forward_gather", "backward_gather", "reduce_scatter"))
    zero_pp = sum(node_link(4, phase) for phase in ("forward_gather", "backward_gather", "reduce_scatter"))
    assert ours <= zero_pp


def bytes_per_step(rank, world_size, config):
    topology = Topology.from_environment(ranks_per_node=2)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    model = ShardedModel(GPT(GPTConfig.preset("tiny", block_size=16)), topology, config, unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    steps = []
    for step in range(4):
        model.set_training_step(step)
        model.comm_log.reset()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        measured = model.comm_log.totals_by_phase()
        steps.append({phase: measured[phase]["received_inter_node"] for phase in ("forward_gather", "reduce_scatter")})
    return steps


def test_late_bits_switch_formats_at_the_given_step():
    config = ZeroConfig(quantized_weights=True, hpz_size=2, quantized_gradients=True, two_hop_weight_gather=True,
                        gradient_bits_intra_node=8, gradient_bits_inter_node=8, quantization_block_size=BLOCK,
                        late_bits_from_step=2, late_weight_bits=12, late_gradient_bits_inter_node=4)
    assert config.at_step(1) == config
    assert (config.at_step(2).weight_bits, config.at_step(2).gradient_bits_inter_node) == (12, 4)
    steps = spawn_ranks(bytes_per_step, 4, (config,))[0]
    assert steps[0] == steps[1] and steps[2] == steps[3]
    # INT8 -> INT12 weights: 1.5x the codes; INT8 -> INT4 gradients: half the codes (scales stay).
    assert steps[2]["forward_gather"] > 1.4 * steps[1]["forward_gather"]
    assert steps[2]["reduce_scatter"] < 0.55 * steps[1]["reduce_scatter"]


def test_backward_gathers_across_nodes_and_qgz_never_share_a_group_order():
    # Without hpZ the backward gathers cross nodes on "inter_node" at points the program
    # fixes, while qgZ launches its inter-node hops whenever their intra-node hop arrives:
    # on one group the two would interleave differently on different ranks. The debug
    # check compares every collective's fingerprint across the group before it runs.
    config = ZeroConfig(two_hop_weight_gather=True, quantized_weights=True, quantized_gradients=True,
                        gradient_chunks=4, quantization_block_size=BLOCK, debug_collective_order=True)
    for (run,) in spawn_ranks(train_losses, 4, ([config],)):
        assert len(run["losses"]) == 4 and all(torch.isfinite(torch.tensor(run["losses"])))
