"""Per-step losses of the sharded model equal a single-process reference (fp32, AdamW)."""

import pytest

from parity import SCENARIOS, STEPS, train_reference, train_sharded
from zeropp import Topology
from zeropp.launch import spawn_ranks

LAYOUTS = {2: 2, 3: 3, 4: 2}  # world size -> ranks per node (4 ranks act as 2 nodes x 2)


def run_all_scenarios(rank, world_size):
    topology = Topology.from_environment(ranks_per_node=LAYOUTS[world_size])
    return {s.name: train_sharded(s, rank, world_size, topology) for s in SCENARIOS}


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_losses_match_single_process(world_size):
    sharded = spawn_ranks(run_all_scenarios, world_size)[0]
    for scenario in SCENARIOS:
        reference = train_reference(scenario, world_size)
        got = sharded[scenario.name]
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, reference)):
            assert abs(a - b) <= 1e-5 * abs(b), (scenario.name, step, a, b)
