"""The schemes auto mode chooses from, as overrides of the user's config."""

from __future__ import annotations

from dataclasses import replace

from ..config import ZeroConfig


def candidates(ranks_per_node: int) -> dict[str, dict[str, object]]:
    """The schemes auto mode chooses from, as config overrides, exact ZeRO-3 first."""
    choices = candidate_schemes(ranks_per_node)
    if ranks_per_node == 1:  # a node of one rank: no secondary to share, the two-hop gather is a ring
        return {name: choices[name] for name in ("zero3", "qwz", "qgz", "qwz+qgz")}
    return choices


def candidate_schemes(ranks_per_node: int) -> dict[str, dict[str, object]]:
    """All seven candidates as config overrides, also where a node of one rank makes some
    of them equal (the benchmarks run them by name on any layout)."""
    off = {"quantized_weights": False, "two_hop_weight_gather": False, "hpz_size": 1, "quantized_gradients": False}
    hpz = {"hpz_size": ranks_per_node}
    return {
        "zero3": off,
        "hpz": {**off, **hpz},
        "qwz": {**off, "quantized_weights": True},
        "qgz": {**off, "quantized_gradients": True},
        "qwz+qgz": {**off, "quantized_weights": True, "quantized_gradients": True},
        "zero++": {**off, "quantized_weights": True, "quantized_gradients": True, **hpz},
        "zero++-two-hop": {**off, "quantized_weights": True, "quantized_gradients": True, "two_hop_weight_gather": True,
                           **hpz},
    }


def scheme(config: ZeroConfig, overrides: dict[str, object]) -> ZeroConfig:
    """The fixed-scheme config a candidate runs (auto off: the choice is made)."""
    return replace(config, auto=False, **overrides)
