"""The specification of block quantization, one block and one byte at a time.

Slow on purpose: it is what ``blocks.py`` must reproduce code for code.
"""

from __future__ import annotations

import torch

from .blocks import BlockFormat


def reference_quantize(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[n] values -> packed uint8 [P] (see the layout in ``blocks.py``)."""
    values = values.float().reshape(-1)
    fmt.check_numel(values.numel())
    codes: list[int] = []
    scales: list[torch.Tensor] = []
    for start in range(0, values.numel(), fmt.block_size):
        block = values[start : start + fmt.block_size]
        absmax = block.abs().max()
        scale = absmax / fmt.max_code if absmax > 0 else torch.tensor(1.0)
        scales.append(scale.reshape(1))
        for value in block:
            code = int(torch.round(value / scale).clamp(-fmt.max_code, fmt.max_code))
            codes.append(code)
    if fmt.bits == 8:
        code_bytes = [code & 0xFF for code in codes]  # two's complement byte of the int8
    else:
        code_bytes = [(codes[i] + 8) | ((codes[i + 1] + 8) << 4) for i in range(0, len(codes), 2)]
    scale_bytes = torch.cat(scales).view(torch.uint8)
    return torch.cat([torch.tensor(code_bytes, dtype=torch.uint8), scale_bytes])


def reference_dequantize(packed: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """packed uint8 [P] -> fp32 [numel]."""
    code_nbytes = fmt.code_nbytes(numel)
    scales = packed[code_nbytes:].clone().view(torch.float32)
    codes: list[int] = []
    for byte in packed[:code_nbytes].tolist():
        if fmt.bits == 8:
            codes.append(byte - 256 if byte > 127 else byte)
        else:
            codes.extend([(byte & 0xF) - 8, (byte >> 4) - 8])
    values = torch.tensor(codes, dtype=torch.float32)
    return values * scales.repeat_interleave(fmt.block_size)
