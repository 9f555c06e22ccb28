"""Vectorised block quantization: the fast path, held to ``reference.py`` by the tests.

Packed layout of one segment of ``n`` values (``n`` a multiple of the block size B)::

    [ codes: n * bits / 8 bytes | scales: (n / B) fp32 values as 4 * n / B bytes ]

INT8 codes are the int8 values' bytes. INT4 codes hold two values per byte, each stored as
``q + 8`` (a nibble in [1, 15]): byte ``j`` of a block holds the block's element ``j`` in
its low nibble and element ``j + B / 2`` in its high nibble (two contiguous halves, which
vectorises; interleaved pairs do not). INT12 codes, stored as ``q + 2048`` (in [1, 4095]),
pair the same elements in three bytes: ``a = element j``, ``b = element j + B / 2`` give
``a & 0xFF``, ``(a >> 8) | (b & 0xF) << 4``, ``b >> 4``.
INT2 and INT3 codes (for weight deltas), stored as ``q + 2^(bits-1)``, split each block in
eight contiguous eighths: position ``j`` of the eighths makes one word
``sum_k code(k * B / 8 + j) << (bits * k)`` of ``bits`` bytes, stored little-endian.
Batched calls take ``[K, n]`` and return ``[K, packed]``: every row is its own segment, so a
row can be sent to another rank by itself.

Two grids. ``uniform``: value = code * scale, scale = absmax / max_code. ``log`` (4 bits
only): value = sign(code) * 2^(|code| - 7) * scale, scale = absmax, code 0 is 0; the seven
levels per sign run from absmax down to absmax / 64, so a small value keeps its size to
within a third instead of becoming 0. Adam divides every value by its own running scale,
which makes relative error per value the error that counts (see ``zeropp bench grad-error``).
Log codes are packed like INT4 codes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8, 12)
PLANE_BITS = (2, 3)  # packed as eight bit planes per block
GRIDS = ("uniform", "log")
# The log grid's value of each 4-bit code, indexed by code + 8 (index 0, code -8, is unused).
LOG_LEVELS = tuple([0.0] + [-(2.0 ** (code - 7)) for code in range(7, 0, -1)] + [0.0]
                   + [2.0 ** (code - 7) for code in range(1, 8)])


@dataclass(frozen=True)
class BlockFormat:
    bits: int = 8
    block_size: int = 256
    grid: str = "uniform"

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported; allowed values: {list(SUPPORTED_BITS)}")
        if self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {self.block_size}")
        if self.bits in PLANE_BITS and self.block_size % 8:
            raise ValueError(f"{self.bits}-bit codes need a block_size divisible by 8, got {self.block_size}")
        if self.grid not in GRIDS:
            raise ValueError(f"grid={self.grid!r} is not supported; allowed values: {list(GRIDS)}")
        if self.grid == "log" and self.bits != 4:
            raise ValueError(f"the log grid has 4 bits only, got bits={self.bits}")

    @property
    def max_code(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 2047 for INT12, 127 for INT8, 7 for INT4, 1 for INT2

    @property
    def scale_divisor(self) -> int:
        """scale = absmax / scale_divisor: the largest code's level is absmax."""
        return self.max_code if self.grid == "uniform" else 1

    def code_nbytes(self, numel: int) -> int:
        return numel * self.bits // 8

    def packed_nbytes(self, numel: int) -> int:
        self.check_numel(numel)
        return self.code_nbytes(numel) + numel // self.block_size * 4

    def check_numel(self, numel: int) -> None:
        assert numel % self.block_size == 0, f"{numel} values are not whole blocks of {self.block_size}"


def quantize(values: torch.Tensor, fmt: BlockFormat, generator: torch.Generator | None = None) -> torch.Tensor:
    """``values`` [n] or [K, n] (any float dtype) -> packed uint8 [P] or [K, P].

    With a ``generator``, codes are rounded stochastically (``floor(x / step + u)``,
    ``u ~ U[0, 1)``): unbiased in expectation, at the price of more variance."""
    rows = values.reshape(-1, values.shape[-1]) if values.dim() > 1 else values.view(1, -1)
    noise = None if generator is None else torch.rand(rows.shape, generator=generator, device=rows.device)
    packed = pack(*quantize_blocks(rows, fmt, noise))
    return packed if values.dim() > 1 else packed.view(-1)


def quantize_blocks(rows: torch.Tensor, fmt: BlockFormat, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel: ``rows`` [K, n] -> (code bytes uint8 [K, n * bits / 8], scales fp32 [K, n / B]).

    Per block: ``scale = absmax / max_code``, ``code = round(x * (max_code / absmax))``
    (0 for an all-zero block). Multiplying by the reciprocal instead of dividing by the
    scale is part of the specification: it compiles to a loop at memory speed.
    """
    num_rows, numel = rows.shape
    fmt.check_numel(numel)
    # One fp32 working copy, then in-place passes: fresh full-size temporaries cost page
    # faults on CPU, which showed up as a third of the quantizer's time.
    blocks = rows.to(torch.float32, copy=True).view(num_rows, numel // fmt.block_size, fmt.block_size)
    # [K, n/B, 1]: max |x| from two reductions, without an |x| temporary (torch.aminmax
    # is 4x slower than amax + amin on CPU)
    absmax = torch.maximum(blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True).neg_())
    inverse = torch.where(absmax > 0, fmt.scale_divisor / absmax, torch.zeros_like(absmax))
    codes = blocks.mul_(inverse).view(num_rows, numel)
    if fmt.grid == "log":
        assert noise is None, "stochastic rounding is for the uniform grid"
        codes = _log_codes(codes)
    elif noise is None:
        codes.round_()
    else:  # |scaled| <= max_code, so floor(scaled + u) stays within [-max_code, max_code]
        codes.add_(noise).floor_()
    if fmt.bits == 8:
        code_bytes = codes.to(torch.int8).view(torch.uint8)
    elif fmt.bits in PLANE_BITS:
        code_bytes = _pack_planes(codes.add_(fmt.max_code + 1).to(torch.int32), fmt)
    elif fmt.bits == 4:
        halves = codes.add_(8).to(torch.uint8).view(num_rows, -1, 2, fmt.block_size // 2)
        code_bytes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(num_rows, numel // 2)
    else:
        halves = codes.add_(2048).to(torch.int32).view(num_rows, -1, 2, fmt.block_size // 2)
        low, high = halves[:, :, 0], halves[:, :, 1]
        triples = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=-1)
        code_bytes = triples.to(torch.uint8).view(num_rows, fmt.code_nbytes(numel))
    return code_bytes, (absmax / fmt.scale_divisor).view(num_rows, -1)


def _pack_planes(codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Offset codes int32 [K, n] -> bytes uint8 [K, n * bits / 8] (the eight-plane layout)."""
    num_rows, numel = codes.shape
    planes = codes.view(num_rows, -1, 8, fmt.block_size // 8)  # [K, blocks, eighth, position]
    words = planes[:, :, 0].clone()
    for eighth in range(1, 8):
        words |= planes[:, :, eighth] << (fmt.bits * eighth)
    code_bytes = torch.stack([(words >> (8 * byte)) & 0xFF for byte in range(fmt.bits)], dim=-1)
    return code_bytes.to(torch.uint8).view(num_rows, fmt.code_nbytes(numel))


def _unpack_planes(code_bytes: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """Inverse of :func:`_pack_planes`, minus the offset: int32 codes [K, numel]."""
    num_rows = code_bytes.shape[0]
    grouped = code_bytes.reshape(num_rows, -1, fmt.block_size // 8, fmt.bits).to(torch.int32)
    words = grouped[..., 0].clone()
    for byte in range(1, fmt.bits):
        words |= grouped[..., byte] << (8 * byte)
    mask = (1 << fmt.bits) - 1
    planes = torch.stack([(words >> (fmt.bits * eighth)) & mask for eighth in range(8)], dim=2)
    return planes.view(num_rows, numel) - (fmt.max_code + 1)


def _log_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Values in [-1, 1] -> log-grid codes in [-7, 7] (as floats), the nearest level with
    ties away from zero. With ``|x| = m * 2^e``, m in [0.5, 1) (exact, from frexp), ``|x|``
    lies between the levels 2^(e-1) (code e + 6) and 2^e, and their midpoint is m = 0.75.
    Below 2^-7, half the smallest level, a value becomes 0."""
    mantissa, exponent = torch.frexp(scaled.abs())
    magnitude = (exponent + 6 + (mantissa >= 0.75).to(exponent.dtype)).clamp_(1, 7).to(scaled.dtype)
    magnitude = torch.where(scaled.abs() >= 2.0**-7, magnitude, torch.zeros_like(magnitude))
    return magnitude.mul_(scaled.sign())


def pack(code_bytes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One uint8 buffer per row, [K, codes | scales], so one collective carries both."""
    return torch.cat([code_bytes, scales.view(torch.uint8)], dim=1)


@functools.cache
def _compiled_quantize_blocks():
    return torch.compile(quantize_blocks, dynamic=False)


def _quantize_and_pack(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    return pack(*quantize_blocks(rows, fmt))


@functools.cache
def _compiled_quantize_and_pack():
    # Packing inside the compiled graph lets codes and scales be written straight into the
    # one output buffer instead of copied there afterwards.
    return torch.compile(_quantize_and_pack, dynamic=False)


def quantize_compiled(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """:func:`quantize` with the kernel through ``torch.compile`` (the first call per shape
    compiles, which takes seconds). Same codes as :func:`quantize`."""
    rows = values.reshape(-1, values.shape[-1]) if values.dim() > 1 else values.view(1, -1)
    packed = _compiled_quantize_and_pack()(rows, fmt)
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
    elif fmt.bits in PLANE_BITS:
        codes = _unpack_planes(code_bytes, fmt, numel)
    elif fmt.bits == 4:
        per_block = code_bytes.reshape(num_rows, -1, fmt.block_size // 2)
        low = (per_block & 0xF).to(torch.int8) - 8
        high = (per_block >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=2).view(num_rows, numel)
    else:
        triples = code_bytes.reshape(num_rows, -1, fmt.block_size // 2, 3).to(torch.int32)
        low = triples[..., 0] | ((triples[..., 1] & 0xF) << 8)
        high = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
        codes = torch.stack([low, high], dim=2).view(num_rows, numel) - 2048
    if fmt.grid == "log":
        codes = _log_levels(codes.device)[codes.to(torch.int64) + 8]
    blocks = codes.view(num_rows, numel // fmt.block_size, fmt.block_size).float().mul_(scales.unsqueeze(-1))
    values = blocks.view(num_rows, numel).to(dtype)
    return values if packed.dim() > 1 else values.view(-1)


@functools.cache
def _log_levels(device: torch.device) -> torch.Tensor:
    """:data:`LOG_LEVELS` on ``device``, built once: dequantizing runs on every inter-node hop."""
    return torch.tensor(LOG_LEVELS, dtype=torch.float32, device=device)


def quantizer(compiled: bool):
    """The quantize function to use: compiled or eager, which produce the same codes."""
    return quantize_compiled if compiled else quantize
