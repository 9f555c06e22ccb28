"""The README's quickstart, run as rank 1 of 4 in a dry run (meta device for the GPU):
every tensor it makes must be on the model's device, as it must be on a GPU."""

import re
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import zeropp.launch
from zeropp import Topology
from zeropp.memory_tracker import LiveTensorTracker

README = Path(__file__).resolve().parent.parent / "README.md"


def quickstart_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


@pytest.fixture
def dry_run_world(monkeypatch):
    def join():  # what init_from_torchrun does, on a fake world where this process is rank 1
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        return 1, 4

    from_environment = Topology.from_environment.__func__
    monkeypatch.setattr(zeropp.launch, "init_from_torchrun", join)
    monkeypatch.setattr(Topology, "from_environment",
                        classmethod(lambda cls, **kwargs: from_environment(cls, **{**kwargs, "device": "meta"})))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_quickstart_keeps_every_tensor_on_the_model_device(dry_run_world):
    code = quickstart_code().replace("range(20)", "range(2)")
    with LiveTensorTracker(dry_run=True) as tracker:
        exec(compile(code, str(README), "exec"), {"__name__": "quickstart"})
    assert not [where for where in tracker.host_syncs if "backward" in where or "forward" in where]
