"""Running a zeropp command on an emulated cluster with torchrun in every node."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .emulated import ClusterSpec, EmulatedCluster

MASTER_PORT = 29517


ZEROPP_CLI = ["-m", "zeropp_tools.cli.main"]


def torchrun_command(spec: ClusterSpec, node: int, master: str, arguments: list[str], program: list[str],
                     python: str = sys.executable, max_restarts: int = 0, local: str | None = None) -> list[str]:
    """torchrun on one node. With restarts, the c10d rendezvous: when one node's workers
    fail, every node's agent restarts its workers into a new rendezvous round."""
    if max_restarts:
        # Node 0 hosts the rendezvous store: torchrun would compare the endpoint with the
        # host name, which in a network namespace is the machine's, not the node's address.
        # The workers meet at the address of the node that hosts rank 0, which is --local-addr.
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{MASTER_PORT}", "--rdzv-id", "zeropp",
                      "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--max-restarts", str(max_restarts),
                      "--local-addr", local or master]
    else:
        rendezvous = ["--node-rank", str(node), "--master-addr", master, "--master-port", str(MASTER_PORT)]
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(spec.num_nodes), "--nproc-per-node", str(spec.ranks_per_node), *rendezvous,
        *program, *arguments,
    ]


def run_on_cluster(
    spec: ClusterSpec, arguments: list[str], timeout_s: float = 3600, logs: Path | None = None,
    program: list[str] = ZEROPP_CLI, python: str = sys.executable, environment: dict | None = None,
    max_restarts: int = 0, during: Callable[[EmulatedCluster], object] | None = None,
) -> dict:
    """Run ``zeropp <arguments>`` (or another torchrun ``program``) over the cluster; returns
    exit codes, node-0 output and the bytes each node's link carried during the run.
    ``during(cluster)`` runs in a thread while the job runs (to inject a fault); what it
    returns is the result's "during"."""
    logs = Path(logs or tempfile.mkdtemp(prefix="zeropp-cluster-"))
    logs.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(spec) as cluster:
        before = cluster.interface_bytes()
        environment = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **(environment or {})}
        processes = [
            cluster.popen(
                node, torchrun_command(spec, node, cluster.address(0), arguments, program, python, max_restarts,
                                       cluster.address(node)),
                logs / f"node{node}.log", environment,
            )
            for node in range(spec.num_nodes)
        ]
        outcome: dict = {}
        injector = None
        if during is not None:
            injector = threading.Thread(target=lambda: outcome.update(during=during(cluster)), daemon=True)
            injector.start()
        codes, exit_times = _wait_all(processes, timeout_s)
        after = cluster.interface_bytes()
        if injector is not None:
            injector.join(timeout=60)
    link_bytes = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]
    return {
        "exit_codes": codes,
        "link_bytes": link_bytes,
        "output": (logs / "node0.log").read_text(),
        "logs": str(logs),
        "namespaces_left": cluster.existing_namespaces(),
        "exit_times": exit_times,
        "during": outcome.get("during"),
    }


def _wait_all(processes: list[subprocess.Popen], timeout_s: float) -> tuple[list, list]:
    """Exit codes (None: still running at the deadline; close() kills it) and the
    ``time.monotonic()`` at which each node's torchrun was seen to exit."""
    deadline = time.monotonic() + timeout_s
    codes, exit_times = [None] * len(processes), [None] * len(processes)
    while time.monotonic() < deadline and any(code is None for code in codes):
        for index, process in enumerate(processes):
            if codes[index] is None and process.poll() is not None:
                codes[index], exit_times[index] = process.returncode, time.monotonic()
        time.sleep(0.1)
    return codes, exit_times
