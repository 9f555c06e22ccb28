"""Running a zeropp command on an emulated cluster with torchrun in every node."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .emulated import ClusterSpec, EmulatedCluster

MASTER_PORT = 29517


ZEROPP_CLI = ["-m", "zeropp_tools.cli.main"]


def torchrun_command(spec: ClusterSpec, node: int, master: str, arguments: list[str], program: list[str],
                     python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(spec.num_nodes), "--node-rank", str(node), "--nproc-per-node", str(spec.ranks_per_node),
        "--master-addr", master, "--master-port", str(MASTER_PORT),
        *program, *arguments,
    ]


def run_on_cluster(
    spec: ClusterSpec, arguments: list[str], timeout_s: float = 3600, logs: Path | None = None,
    program: list[str] = ZEROPP_CLI, python: str = sys.executable, environment: dict | None = None,
) -> dict:
    """Run ``zeropp <arguments>`` (or another torchrun ``program``) over the cluster; returns
    exit codes, node-0 output and the bytes each node's link carried during the run."""
    logs = Path(logs or tempfile.mkdtemp(prefix="zeropp-cluster-"))
    logs.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(spec) as cluster:
        before = cluster.interface_bytes()
        environment = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **(environment or {})}
        processes = [
            cluster.popen(
                node, torchrun_command(spec, node, cluster.address(0), arguments, program, python),
                logs / f"node{node}.log", environment,
            )
            for node in range(spec.num_nodes)
        ]
        deadline = time.monotonic() + timeout_s
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)  # close() kills whatever is left
        after = cluster.interface_bytes()
    link_bytes = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    return {
        "exit_codes": codes,
        "link_bytes": link_bytes,
        "output": (logs / "node0.log").read_text(),
        "logs": str(logs),
        "namespaces_left": cluster.existing_namespaces(),
    }
