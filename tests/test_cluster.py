"""The emulated cluster: torchrun in two network namespaces over a shaped link."""

import json
import subprocess

import pytest

from zeropp_tools.cluster import ClusterSpec
from zeropp_tools.cluster.emulated import payload_bytes, probe_emulation
from zeropp_tools.cluster.runner import run_on_cluster

MISSING = probe_emulation()  # what this machine lacks to emulate a cluster; None: nothing
TRAIN = ["train", "--model", "small", "--steps", "3", "--batch-per-rank", "2", "--seq-len", "32"]


@pytest.mark.skipif(MISSING is not None, reason=f"cannot emulate a cluster here: {MISSING}")
def test_two_nodes_train_over_a_shaped_link_and_clean_up(tmp_path):
    result = run_on_cluster(ClusterSpec(2, 2, bandwidth_mbit=200), TRAIN + ["--out", str(tmp_path)], timeout_s=240)
    assert result["exit_codes"] == [0, 0], result["output"][-2000:]
    assert "communication per step" in result["output"]
    for counters in result["link_bytes"]:  # both links carried the inter-node traffic
        assert counters["tx_bytes"] > 1e6 and counters["rx_bytes"] > 1e6
    assert result["namespaces_left"] == []
    # What each node's link carried in agrees with the accounting of its ranks (ring
    # all-gathers, pairwise all-to-alls), init and evaluation included.
    summary = json.loads((tmp_path / "summary.json").read_text())
    for node, counters in enumerate(result["link_bytes"]):
        accounted = sum(summary["comm_total_by_rank"][rank]["received_inter_node"] for rank in (2 * node, 2 * node + 1))
        assert abs(counters["rx_bytes"] - accounted) <= 0.05 * accounted, (node, counters, accounted)
        assert abs(payload_bytes(counters) - accounted) <= 0.01 * accounted, (node, counters, accounted)
    assert "zpp" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bad_specs_are_named():
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        ClusterSpec(2, 2, bandwidth_mbit=0)
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSpec(0, 2)


@pytest.mark.skipif(MISSING is None, reason="this machine can emulate a cluster (tested above)")
def test_without_namespaces_the_error_says_what_is_needed(tmp_path):
    with pytest.raises(RuntimeError, match="needs|cannot|failed"):
        run_on_cluster(ClusterSpec(2, 2), TRAIN, timeout_s=30)
