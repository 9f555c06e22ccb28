"""Allowed sets and argparse value types shared by the subcommands' flags."""

from __future__ import annotations

import argparse

from zeropp.config import DELTA_BITS, DTYPES, GRADIENT_SCALE_DTYPES, QUANTIZATION_BITS
from zeropp.models.gpt import GPT_PRESETS
from zeropp.quantization.blocks import GRIDS

MODEL_SIZES = tuple(GPT_PRESETS)
PRECISIONS = tuple(DTYPES)
BIT_WIDTHS = QUANTIZATION_BITS
DELTA_BIT_WIDTHS = DELTA_BITS
GRADIENT_GRIDS = tuple(GRIDS)
__all__ = ["BIT_WIDTHS", "DELTA_BIT_WIDTHS", "GRADIENT_GRIDS", "GRADIENT_SCALE_DTYPES", "MODEL_SIZES", "PRECISIONS"]


def positive_int(text: str) -> int:
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    return _bounded_int(text, 0)


def _bounded_int(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be an integer >= {lowest}, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return value


def gradient_bit_pair(text: str) -> tuple[int, int]:
    """``"4,8"`` -> (4, 8): qgZ bits of the intra-node and the inter-node hop."""
    parts = text.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"must look like 4,4 (intra-node,inter-node bits), got {text!r}")
    pair = (int(parts[0]), int(parts[1]))
    for bits in pair:
        if bits not in BIT_WIDTHS:
            raise argparse.ArgumentTypeError(f"{bits} bits is not supported; allowed values: {list(BIT_WIDTHS)}")
    return pair
