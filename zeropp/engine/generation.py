"""Generation mode: each unit gathered once per ``generate()`` call and kept (pinned)
while tokens are decoded, then released (docs/design.md section 2).

Outside it, every no-grad forward gathers and frees each unit again: one gather per unit
per token. With hpZ, gathers after the first come from the secondary copy inside the
node; frozen weights keep that copy across calls (MixZ++ keeps it INT8).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

ANCHOR = "zeropp_device_anchor"


class PinnedUnits:
    """The units kept gathered, least recently used first: the root (its forward encloses
    every other unit's) and at most ``limit`` others (None: all)."""

    def __init__(self, model, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_pinned_units must be >= 1 (or None for all), got {limit}")
        self.model = model
        self.limit = limit
        self.order: OrderedDict[int, None] = OrderedDict()
        self.with_views: set[int] = set()  # units whose no-grad views, installed once, still stand

    def install_views(self, unit) -> None:
        """A pinned unit's buffer stays put between tokens, and so do the no-grad views into
        it: install them at its first forward only (per token it took 6-10% of decoding)."""
        if torch.is_grad_enabled():  # views recording autograd; the next no-grad forward installs its own
            self.with_views.discard(unit.index)
            unit.install_views()
        elif unit.index not in self.with_views:
            unit.install_views()
            self.with_views.add(unit.index)

    def keep(self, unit) -> None:
        """Called after ``unit``'s forward: keep it gathered, releasing the oldest beyond the limit."""
        if unit.is_root:
            return
        self.order[unit.index] = None
        self.order.move_to_end(unit.index)
        while self.limit is not None and len(self.order) > self.limit:
            oldest, _ = self.order.popitem(last=False)
            self.with_views.discard(oldest)
            self.model._gathering.free(self.model.units[oldest])


@contextmanager
def generation_mode(model, max_pinned_units: int | None = None) -> Iterator[None]:
    """No-grad forwards inside the block keep each unit gathered after its first use;
    everything is released on exit (so resting memory returns)."""
    if model._pinned is not None:
        raise ValueError("generation mode is already on for this model")
    model._pinned = PinnedUnits(model, max_pinned_units)
    # Generation code asks the module for its device and dtype through its parameters
    # (Hugging Face's model.device), and wrapping removed them: one empty parameter answers.
    anchor = nn.Parameter(torch.empty(0, dtype=model.config.compute_torch_dtype, device=model.topology.device),
                          requires_grad=False)
    model.module.register_parameter(ANCHOR, anchor)
    try:
        with torch.no_grad():
            yield
    finally:
        del model.module._parameters[ANCHOR]
        model._pinned = None
        model._gathering.free_all()


def gathered_bytes(model) -> int:
    """Bytes of gathered (full) buffers this rank holds right now."""
    return sum(flat.full.untyped_storage().nbytes() for flat in model.flat_params())
