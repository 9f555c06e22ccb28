"""The specification of block quantization, one block and one byte at a time.

Slow on purpose: it is what ``blocks.py`` must reproduce code for code.
"""

from __future__ import annotations

import torch

from .blocks import BlockFormat


def _log_code(scaled: float) -> int:
    """The log grid's nearest level to ``scaled`` in [-1, 1], ties away from zero: walk the
    levels 0, 2^-6, ..., 1 and keep the last one whose midpoint with the one below is reached."""
    levels = [0.0] + [2.0 ** (code - 7) for code in range(1, 8)]
    magnitude = 0
    for code in range(1, 8):
        if abs(scaled) >= (levels[code - 1] + levels[code]) / 2:
            magnitude = code
    return magnitude if scaled >= 0 else -magnitude


def reference_quantize(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[n] values -> packed uint8 [P] (see the layout in ``blocks.py``)."""
    values = values.float().reshape(-1)
    fmt.check_numel(values.numel())
    codes: list[int] = []
    scales: list[torch.Tensor] = []
    for start in range(0, values.numel(), fmt.block_size):
        block = values[start : start + fmt.block_size]
        absmax = block.abs().max()
        inverse = fmt.scale_divisor / absmax if absmax > 0 else torch.tensor(0.0)
        scales.append((absmax / fmt.scale_divisor).reshape(1))
        for value in block:
            scaled = value * inverse
            codes.append(_log_code(scaled.item()) if fmt.grid == "log" else int(torch.round(scaled)))
    half = fmt.block_size // 2
    code_bytes = []
    if fmt.bits == 8:
        code_bytes = [code & 0xFF for code in codes]  # two's complement byte of the int8
    elif fmt.bits in (2, 3):
        eighth = len(codes) // 8
        # one word per position j: element k * n/8 + j at bit bits * k; byte 0 of every word
        # in order of j, then byte 1, ...
        words = [sum((codes[k * eighth + j] + fmt.max_code + 1) << (fmt.bits * k) for k in range(8))
                 for j in range(eighth)]
        code_bytes = [(word >> (8 * byte)) & 0xFF for byte in range(fmt.bits) for word in words]
    elif fmt.bits == 4:
        for start in range(0, len(codes), fmt.block_size):
            for j in range(half):  # element j low, element j + B/2 high
                code_bytes.append((codes[start + j] + 8) | ((codes[start + half + j] + 8) << 4))
    else:
        for start in range(0, len(codes), fmt.block_size):
            for j in range(half):  # 12 bits of element j, then 12 bits of element j + B/2
                low, high = codes[start + j] + 2048, codes[start + half + j] + 2048
                code_bytes += [low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4]
    scale_bytes = torch.cat(scales).view(torch.uint8)
    return torch.cat([torch.tensor(code_bytes, dtype=torch.uint8), scale_bytes])


def reference_dequantize(packed: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """packed uint8 [P] -> fp32 [numel]."""
    code_nbytes = fmt.code_nbytes(numel)
    scales = packed[code_nbytes:].clone().view(torch.float32)
    code_bytes = packed[:code_nbytes].tolist()
    codes: list[int] = []
    half = fmt.block_size // 2
    if fmt.bits == 8:
        codes = [byte - 256 if byte > 127 else byte for byte in code_bytes]
    elif fmt.bits in (2, 3):
        eighth, mask = numel // 8, (1 << fmt.bits) - 1
        words = [sum(code_bytes[byte * eighth + j] << (8 * byte) for byte in range(fmt.bits)) for j in range(eighth)]
        codes = [((word >> (fmt.bits * k)) & mask) - fmt.max_code - 1 for k in range(8) for word in words]
    elif fmt.bits == 4:
        for start in range(0, len(code_bytes), half):
            block = code_bytes[start : start + half]
            codes.extend([(byte & 0xF) - 8 for byte in block] + [(byte >> 4) - 8 for byte in block])
    else:
        for start in range(0, len(code_bytes), 3 * half):
            block = code_bytes[start : start + 3 * half]
            triples = [block[3 * j : 3 * j + 3] for j in range(half)]
            codes.extend([a | ((b & 0xF) << 8) for a, b, _ in triples])
            codes.extend([(b >> 4) | (c << 4) for _, b, c in triples])
        codes = [code - 2048 for code in codes]
    if fmt.grid == "log":
        values = torch.tensor([0.0 if code == 0 else (1 if code > 0 else -1) * 2.0 ** (abs(code) - 7) for code in codes])
    else:
        values = torch.tensor(codes, dtype=torch.float32)
    return values * scales.repeat_interleave(fmt.block_size)
