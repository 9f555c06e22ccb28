"""Faults survived with nothing lost (``zeropp bench faults`` runs the same scenarios and
records them): a full disk during a save here; the link and node faults on the emulated
cluster and the 3,000-step soak are long, marked slow (``pytest -m slow tests/test_faults.py``)."""

import subprocess
import tempfile
from pathlib import Path

import pytest

from zeropp_tools.bench import faults
from zeropp_tools.cluster.emulated import probe_emulation


def _probe_mount() -> str | None:
    """None when this machine can mount a tmpfs (root in its own mount namespace), else why not."""
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], capture_output=True, text=True)
        if result.returncode != 0:
            return result.stderr.strip() or "mount failed"
        subprocess.run(["umount", folder], capture_output=True)
    return None


MOUNT_MISSING = _probe_mount()
CLUSTER_MISSING = probe_emulation()


@pytest.mark.skipif(MOUNT_MISSING is not None, reason=f"cannot mount a small tmpfs here: {MOUNT_MISSING}")
def test_disk_full_names_path_and_bytes_and_keeps_the_previous_checkpoint(tmp_path):
    row = faults.disk_full(tmp_path)
    stopped = row["policies"]["stop"]["outcome"]
    assert "needs" in stopped and "bytes" in stopped and str(tmp_path / "disk_stop") in stopped, stopped
    assert row["policies"]["continue"]["outcome"] == "trained to step 30"
    assert row["ok"], row


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, metrics = faults._cluster_run(tmp_path_factory.mktemp("undisturbed"), [])
    assert result["exit_codes"] == [0, 0], result["output"][-2000:]
    return faults.read_losses(metrics)


@pytest.mark.slow
@pytest.mark.skipif(CLUSTER_MISSING is not None, reason=f"cannot emulate a cluster here: {CLUSTER_MISSING}")
def test_link_flap_changes_nothing(tmp_path, reference):
    row = faults.link_flap(tmp_path, reference)
    assert row["ok"], row


@pytest.mark.slow
@pytest.mark.skipif(CLUSTER_MISSING is not None, reason=f"cannot emulate a cluster here: {CLUSTER_MISSING}")
def test_link_down_ends_every_rank_within_the_timeout(tmp_path):
    row = faults.link_down(tmp_path)
    assert row["ok"], row


@pytest.mark.slow
@pytest.mark.skipif(CLUSTER_MISSING is not None, reason=f"cannot emulate a cluster here: {CLUSTER_MISSING}")
def test_killed_node_restarts_and_resumes_exactly(tmp_path, reference):
    row = faults.node_killed(tmp_path, reference)
    assert row["ok"], row


@pytest.mark.slow
def test_soak_keeps_memory_files_and_threads_flat(tmp_path):
    row = faults.soak(tmp_path)
    assert row["ok"], row
    assert Path(tmp_path / "soak.png").exists()
