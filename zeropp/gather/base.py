"""What every weight gather provides (docs/design.md section 4).

A gather fills ``flat.full`` (the unit's whole flat buffer in the compute dtype) from the
ranks' shards, in two calls so the engine can prefetch: ``start`` launches the collectives,
``finish`` waits and writes the buffer. A strategy owns whatever it keeps per flat parameter
between gathers (a quantized shard, a secondary copy) and drops it in ``invalidate`` when
the master shard changes. ``predicted_bytes`` is its analytic volume, which the accounting
sums and the tests hold equal to what the communicator recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..traffic import Traffic
from ..config import ZeroConfig
from ..topology import Layout

if TYPE_CHECKING:
    from ..collectives import Communicator
    from ..sharding import FlatParam
    from ..topology import Topology


class WeightGather:
    """Base of the gather strategies. Built with only a config it can predict bytes; the
    engine also gives it the topology and communicator to run."""

    def __init__(self, config: ZeroConfig, topology: "Topology | None" = None,
                 communicator: "Communicator | None" = None) -> None:
        self.config = config
        self.topology = topology
        self.comm = communicator

    # ------------------------------------------------------------------ running
    def start(self, flat: "FlatParam", phase: str) -> object:
        """Launch the gather into ``flat.full_data`` (storage allocated); return a pending
        object for :meth:`finish`."""
        raise NotImplementedError

    def finish(self, flat: "FlatParam", pending: object) -> torch.Tensor:
        """Wait and fill ``flat.full_data``; return the complete gathered buffer as it
        travelled (packed bytes, or ``flat.full_data``), which hpZ may keep part of."""
        raise NotImplementedError

    def invalidate(self, flat: "FlatParam") -> None:
        """The master shard of ``flat`` changed: drop what was derived from it."""

    def forget(self, flat: "FlatParam") -> None:
        """The master shard of ``flat`` was replaced (loaded, edited): drop everything kept
        for it, state kept across steps included."""
        self.invalidate(flat)

    def kept_tensors(self) -> list[torch.Tensor]:
        """What the strategy holds between gathers (copies, caches), for memory reports."""
        return []

    def kept_bytes(self, shard_numel: int, layout: Layout) -> int:
        """Bytes :meth:`kept_tensors` holds for one flat of ``shard_numel`` values per rank
        once it has been gathered (the memory model's prediction)."""
        return 0

    def receive_bytes(self, shard_numel: int, layout: Layout) -> int:
        """Bytes a gather of one flat holds besides its full buffer while in flight."""
        return 0

    def saved_state(self, flat: "FlatParam") -> torch.Tensor | None:
        """State of ``flat`` that a checkpoint must keep for an exact resume (None: none)."""
        return None

    def load_saved_state(self, flat: "FlatParam", state: torch.Tensor) -> None:
        """Take back what :meth:`saved_state` gave, on the same layout."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state in checkpoints")

    @property
    def keeps_packed(self) -> bool:
        """Whether :meth:`finish` returns packed bytes (then :meth:`fill_from_packed` turns
        such a buffer into weights) rather than ``flat.full_data``."""
        return False

    def fill_from_packed(self, flat: "FlatParam", gathered: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not gather packed shards")

    def holds_copy(self, flat: "FlatParam") -> bool:
        """Whether a gathered copy of ``flat`` is kept between gathers (hpZ's secondary)."""
        return False

    def quantization_error_sums(self, flats: list["FlatParam"]) -> tuple[float, float]:
        """(sum of squared errors, sum of squares) of the weights this rank hands out against
        its fp32 masters; (0, 0) when nothing is quantized."""
        return 0.0, 0.0

    def for_flat(self, requires_grad: bool) -> "WeightGather":
        """The gather a flat of this trainability uses (MixZ++ splits them)."""
        return self

    # ------------------------------------------------------------------ bytes
    def chunk_bytes(self, shard_numel: int) -> int:
        """Bytes of one shard as a complete gathered buffer carries it."""
        raise NotImplementedError

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        """Bytes ``rank`` receives for one gather of a flat of ``shard_numel`` values per
        rank in ``phase`` ("forward_gather", or "backward_gather" right after a forward)."""
        raise NotImplementedError

    def collective_steps(self, layout: Layout, phase: str) -> int:
        """Sequential exchanges per gather (ring steps), for the planner's latency term."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    @property
    def compute_itemsize(self) -> int:
        return self.config.compute_torch_dtype.itemsize

    def _world(self):
        return self.topology.group("world")

    def _wait(self, work) -> None:
        if work is not None:
            work.wait()
