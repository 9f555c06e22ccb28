"""qgZ with bf16 block scales (``gradient_scale_dtype="bf16"``): each block's scale costs 2
bytes instead of 4, so blocks of 128 values cost what blocks of 256 cost with fp32 scales,
and a smaller block follows the gradient's local size more closely.

Codes are computed against the fp32 scale exactly as in qgZ; only the stored scale is
rounded to bf16 (a relative error of at most 2^-9 on every value of the block, far below
half an INT4 or INT8 step). Packed layout of one row of n values::

    [ codes: n * bits / 8 bytes | scales: (n / B) bf16 values as 2 * n / B bytes ]
"""

from __future__ import annotations

import torch

from ..quantization import BlockFormat
from .qgz import QgzReduction


class QgzBf16ScalesReduction(QgzReduction):
    def quantize(self, rows: torch.Tensor, fmt: BlockFormat, generator=None) -> torch.Tensor:
        """[K, n] values -> [K, codes | bf16 scales] uint8."""
        packed = super().quantize(rows, fmt, generator)  # [K, codes | fp32 scales]
        codes_nbytes = fmt.code_nbytes(rows.shape[-1])
        scales = packed[:, codes_nbytes:].contiguous().view(torch.float32).to(torch.bfloat16)
        return torch.cat([packed[:, :codes_nbytes], scales.view(torch.uint8)], dim=1)

    def dequantize(self, packed: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
        """[K, codes | bf16 scales] uint8 -> [K, numel] fp32."""
        codes_nbytes = fmt.code_nbytes(numel)
        scales = packed[:, codes_nbytes:].contiguous().view(torch.bfloat16).float()
        widened = torch.cat([packed[:, :codes_nbytes], scales.view(torch.uint8)], dim=1)
        return super().dequantize(widened, fmt, numel)

    def packed_nbytes(self, fmt: BlockFormat, numel: int) -> int:
        fmt.check_numel(numel)
        return fmt.code_nbytes(numel) + numel // fmt.block_size * 2
