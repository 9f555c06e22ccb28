"""Vectorised block quantization: the fast path, held to ``reference.py`` by the tests.

Packed layout of one segment of ``n`` values (``n`` a multiple of the block size B)::

    [ codes: n * bits / 8 bytes | scales: (n / B) fp32 values as 4 * n / B bytes ]

INT8 codes are the int8 values' bytes. INT4 codes hold two values per byte, each stored as
``q + 8`` (a nibble in [1, 15]): element ``2i`` in the low nibble, ``2i + 1`` in the high.
Batched calls take ``[K, n]`` and return ``[K, packed]``: every row is its own segment, so a
row can be sent to another rank by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class BlockFormat:
    bits: int = 8
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported; allowed values: {list(SUPPORTED_BITS)}")
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {self.block_size}")

    @property
    def max_code(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 127 for INT8, 7 for INT4

    def code_nbytes(self, numel: int) -> int:
        return numel * self.bits // 8

    def packed_nbytes(self, numel: int) -> int:
        self.check_numel(numel)
        return self.code_nbytes(numel) + numel // self.block_size * 4

    def check_numel(self, numel: int) -> None:
        assert numel % self.block_size == 0, f"{numel} values are not whole blocks of {self.block_size}"


def block_scales(blocks: torch.Tensor, max_code: int) -> torch.Tensor:
    """fp32 scale per block, ``absmax / max_code``; 1 for an all-zero block (codes are 0)."""
    absmax = blocks.abs().amax(dim=-1, keepdim=True)
    return torch.where(absmax > 0, absmax / max_code, torch.ones_like(absmax))


def quantize(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``values`` [n] or [K, n] (any float dtype) -> packed uint8 [P] or [K, P]."""
    rows = values.reshape(-1, values.shape[-1]) if values.dim() > 1 else values.view(1, -1)
    num_rows, numel = rows.shape
    fmt.check_numel(numel)
    blocks = rows.float().view(num_rows, numel // fmt.block_size, fmt.block_size)
    scales = block_scales(blocks, fmt.max_code)  # [K, n/B, 1]
    codes = torch.round(blocks / scales).clamp_(-fmt.max_code, fmt.max_code).to(torch.int8).view(num_rows, numel)
    if fmt.bits == 8:
        code_bytes = codes.view(torch.uint8)
    else:
        nibbles = (codes + 8).to(torch.uint8).view(num_rows, numel // 2, 2)
        code_bytes = nibbles[..., 0] | (nibbles[..., 1] << 4)
    packed = torch.cat([code_bytes, scales.view(num_rows, -1).view(torch.uint8)], dim=1)
    return packed if values.dim() > 1 else packed.view(-1)


def dequantize(packed: torch.Tensor, fmt: BlockFormat, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: packed [P] or [K, P] -> values [numel] or [K, numel]."""
    rows = packed if packed.dim() > 1 else packed.view(1, -1)
    num_rows = rows.shape[0]
    assert rows.shape[1] == fmt.packed_nbytes(numel), (rows.shape, numel)
    code_nbytes = fmt.code_nbytes(numel)
    code_bytes = rows[:, :code_nbytes]
    scales = rows[:, code_nbytes:].contiguous().view(torch.float32)  # [K, n/B]
    if fmt.bits == 8:
        codes = code_bytes.contiguous().view(torch.int8)
    else:
        low = (code_bytes & 0xF).to(torch.int8) - 8
        high = (code_bytes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=-1).view(num_rows, numel)
    blocks = codes.view(num_rows, numel // fmt.block_size, fmt.block_size).float() * scales.unsqueeze(-1)
    values = blocks.view(num_rows, numel).to(dtype)
    return values if packed.dim() > 1 else values.view(-1)
