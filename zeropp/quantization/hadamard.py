"""Walsh-Hadamard transform over small groups of consecutive values (SDP4Bit).

Rotating each group of ``size`` values by the orthonormal Hadamard matrix spreads an
outlier over the whole group, so a block's absmax (which sets the quantization step) is
closer to its typical magnitude. The transform is linear and its own inverse, so sums of
transformed vectors can be taken before transforming back once.
"""

from __future__ import annotations

import math

import torch


def hadamard(values: torch.Tensor, size: int = 32) -> torch.Tensor:
    """Orthonormal Hadamard transform of every ``size`` consecutive values (last dim)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"hadamard size must be a power of two, got {size}")
    assert values.shape[-1] % size == 0, (values.shape, size)
    rows = values.reshape(-1, size).float()
    half = 1
    while half < size:  # butterfly stage: pairs (i, i + half) inside groups of 2 * half
        pairs = rows.view(-1, size // (2 * half), 2, half)
        rows = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        half *= 2
    return rows.reshape(values.shape) / math.sqrt(size)


def reference_hadamard(values: torch.Tensor, size: int = 32) -> torch.Tensor:
    """The same with an explicit Sylvester matrix: ``H_2n = [[H, H], [H, -H]] / sqrt 2``."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    groups = values.reshape(-1, size).double() @ (matrix.double() / math.sqrt(size)).T
    return groups.reshape(values.shape).float()
