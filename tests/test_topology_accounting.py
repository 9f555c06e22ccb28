"""Pure unit tests: layouts, their errors, and per-peer byte accounting."""

import pytest

from zeropp import Layout, ZeroConfig
from zeropp.accounting import CommLog


def test_layout_ranks_and_groups():
    layout = Layout(world_size=8, ranks_per_node=4)
    assert layout.num_nodes == 2
    assert layout.node_of(5) == 1 and layout.local_index_of(5) == 1
    assert layout.intra_node_ranks(1) == [4, 5, 6, 7]
    assert layout.inter_node_ranks(2) == [2, 6]


@pytest.mark.parametrize(
    "world_size,ranks_per_node,message",
    [(4, 3, "ranks_per_node=3 does not divide world_size=4; allowed values: [1, 2, 4]"), (4, 0, "ranks_per_node"), (0, 1, "world_size")],
)
def test_impossible_layouts_say_what_is_wrong(world_size, ranks_per_node, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Layout(world_size, ranks_per_node)


def test_ring_all_gather_bytes_follow_the_ring():
    # Ring 0 -> 1 -> 2 -> 3 -> 0 on 2 nodes x 2: rank 1 hears from rank 0 (same node) and
    # passes 3 chunks on to rank 2 (the other node).
    log = CommLog(Layout(4, 2), rank=1)
    log.record_ring("all_gather", (0, 1, 2, 3), "forward_gather", chunk_bytes=100)
    record = log.records[0]
    assert record.group == "world"
    assert (record.received_intra_node, record.received_inter_node) == (300, 0)
    assert (record.sent_intra_node, record.sent_inter_node) == (0, 300)
    assert log.totals()["received"] == 300


def test_all_to_all_bytes_split_by_peer():
    log = CommLog(Layout(4, 2), rank=1)
    log.record_exchange("all_to_all", (0, 1, 2, 3), "reduce_scatter", chunk_bytes=100)
    assert (log.records[0].received_intra_node, log.records[0].received_inter_node) == (100, 200)


def test_inter_node_group_is_labelled():
    log = CommLog(Layout(4, 2), rank=1)
    log.record_exchange("all_to_all", (1, 3), "x", chunk_bytes=10)
    assert log.records[0].group == "inter_node"
    assert log.records[0].sent_inter_node == 10 and log.records[0].sent_intra_node == 0


def test_hpz_size_must_divide_the_ranks_per_node():
    ZeroConfig(hpz_size=2).check_layout(4)
    with pytest.raises(ValueError, match=r"hpz_size=3 must divide the ranks per node \(4\); allowed values: \[1, 2, 4\]"):
        ZeroConfig(hpz_size=3).check_layout(4)


@pytest.mark.parametrize(
    "field,value",
    [("compute_dtype", "fp8"), ("reduce_dtype", "int4"), ("prefetch", "yes"), ("shard_alignment", 0),
     ("late_bits_from_step", -1), ("late_weight_bits", 6), ("two_hop_weight_gather", 1),
     ("gradient_grid_inter_node", "cubic")],
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ZeroConfig(**{field: value})


@pytest.mark.parametrize(
    "fields,named",
    [(dict(gradient_bits_inter_node=8), "gradient_bits_inter_node"),
     (dict(late_bits_from_step=5, late_gradient_bits_inter_node=8), "late_gradient_bits_inter_node"),
     (dict(gradient_stochastic_rounding=True), "gradient_stochastic_rounding")],
)
def test_log_grid_rejects_what_it_cannot_do(fields, named):
    with pytest.raises(ValueError, match=named):
        ZeroConfig(gradient_grid_inter_node="log", **fields)
