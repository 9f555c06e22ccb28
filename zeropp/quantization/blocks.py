"""Vectorised block quantization: the fast path, held to ``reference.py`` by the tests.

Packed layout of one segment of ``n`` values (``n`` a multiple of the block size B)::

    [ codes: n * bits / 8 bytes | scales: (n / B) fp32 values as 4 * n / B bytes ]

INT8 codes are the int8 values' bytes. INT4 codes hold two values per byte, each stored as
``q + 8`` (a nibble in [1, 15]): byte ``j`` of a block holds the block's element ``j`` in
its low nibble and element ``j + B / 2`` in its high nibble (two contiguous halves, which
vectorises; interleaved pairs do not). INT12 codes, stored as ``q + 2048`` (in [1, 4095]),
pair the same elements in three bytes: ``a = element j``, ``b = element j + B / 2`` give
``a & 0xFF``, ``(a >> 8) | (b & 0xF) << 4``, ``b >> 4``.
INT2 and INT3 codes (for weight deltas), stored as ``q + 2^(bits-1)``, split each segment of
n values in eight contiguous eighths: position ``j`` of the eighths makes one word
``sum_k code(k * n / 8 + j) << (bits * k)`` of ``bits`` bytes; the segment stores byte 0 of
its n / 8 words, then byte 1, ... (byte planes, so every pass runs over long contiguous
memory: eighths of a block, 32 values at B = 256, left the vector units idle).
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

from . import native

SUPPORTED_BITS = (2, 3, 4, 8, 12)
PLANE_BITS = (2, 3)  # packed as eight bit planes per block
GRIDS = ("uniform", "log")


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
    if generator is None and native.handles(rows, fmt):
        packed = native.quantize(rows, fmt)
        return packed if values.dim() > 1 else packed.view(-1)
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
    # is 4x slower than amax + amin on CPU); adding 0 turns an all-zero block's -0.0 (what
    # a vectorised max may pick from 0.0 and -0.0) into the +0.0 every path stores
    absmax = torch.maximum(blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True).neg_()).add_(0.0)
    inverse = torch.where(absmax > 0, fmt.scale_divisor / absmax, torch.zeros_like(absmax))
    codes = blocks.mul_(inverse).view(num_rows, numel)
    if fmt.grid == "log":
        assert noise is None, "stochastic rounding is for the uniform grid"
        code_bytes = _pack_nibbles(_log_offset_codes(codes), fmt)
    else:
        code_bytes = _uniform_code_bytes(codes, fmt, noise)
    return code_bytes, (absmax / fmt.scale_divisor).view(num_rows, -1)


def _uniform_code_bytes(scaled: torch.Tensor, fmt: BlockFormat, noise: torch.Tensor | None) -> torch.Tensor:
    """fp32 [K, n] in [-max_code, max_code] -> code bytes uint8 [K, n * bits / 8]; rounds in place."""
    num_rows, numel = scaled.shape
    if noise is None:
        scaled.round_()
    else:  # |scaled| <= max_code, so floor(scaled + u) stays within [-max_code, max_code]
        scaled.add_(noise).floor_()
    if fmt.bits == 8:
        return scaled.to(torch.int8).view(torch.uint8)
    if fmt.bits in PLANE_BITS:
        return _pack_planes(scaled.add_(fmt.max_code + 1).to(torch.uint8), fmt)
    if fmt.bits == 4:
        return _pack_nibbles(scaled.add_(8).to(torch.uint8), fmt)
    halves = scaled.add_(2048).to(torch.int32).view(num_rows, -1, 2, fmt.block_size // 2)
    low, high = halves[:, :, 0], halves[:, :, 1]
    triples = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=-1)
    return triples.to(torch.uint8).view(num_rows, fmt.code_nbytes(numel))


def _pack_nibbles(offset_codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 [K, n] codes in [0, 15] -> [K, n / 2]: elements j and j + B / 2 of a block share a byte."""
    num_rows, numel = offset_codes.shape
    halves = offset_codes.view(num_rows, -1, 2, fmt.block_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(num_rows, numel // 2)


def _pack_planes(codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Offset codes uint8 [K, n] -> bytes uint8 [K, n * bits / 8] (the eight-plane layout):
    each eighth is contiguous, so every pass runs over long runs of memory."""
    num_rows, numel = codes.shape
    eighths = codes.view(num_rows, 8, numel // 8).to(torch.int32)  # [K, eighth, position]
    # Whole int32 words, out of place: the uint8 in-place version failed the compiled
    # quantizer's test under ATEN_CPU_CAPABILITY=avx2 and default (possibly through the
    # compile cache shared across kernel sets, which tests/conftest.py now splits).
    words = eighths[:, 0].clone()
    for eighth in range(1, 8):
        words |= eighths[:, eighth] << (fmt.bits * eighth)
    code_bytes = torch.stack([(words >> (8 * byte)) & 0xFF for byte in range(fmt.bits)], dim=1)  # [K, byte, position]
    return code_bytes.to(torch.uint8).view(num_rows, fmt.code_nbytes(numel))


def _unpack_planes(code_bytes: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """Inverse of :func:`_pack_planes`, minus the offset: int8 codes [K, numel]."""
    num_rows = code_bytes.shape[0]
    planes = code_bytes.reshape(num_rows, fmt.bits, numel // 8)  # [K, byte, position]
    codes = code_bytes.new_empty(num_rows, 8, numel // 8)  # [K, eighth, position]
    mask = (1 << fmt.bits) - 1
    for eighth in range(8):
        byte, shift = divmod(fmt.bits * eighth, 8)
        target = codes[:, eighth]
        torch.bitwise_right_shift(planes[:, byte], shift, out=target)
        if shift + fmt.bits > 8:  # the code runs on into the next byte
            target.bitwise_or_(planes[:, byte + 1] << (8 - shift))
        target.bitwise_and_(mask)
    return codes.view(num_rows, numel).view(torch.int8).sub_(fmt.max_code + 1)  # codes < 2^3 fit int8


@functools.cache
def _log_code_table(device: torch.device) -> torch.Tensor:
    """uint8 [1024]: the log-grid code plus 8 of a float32 in [-1, 1], indexed by its top
    ten bits (sign, exponent E, the mantissa's top bit t). With ``|x| = 1.f * 2^(E - 127)``
    the levels 2^(E-127) and 2^(E-126) have their midpoint at 1.f = 1.5, where t turns on,
    so the nearest level (ties away from zero) is code ``E + t - 120``, at least 1 from
    half the smallest level (2^-7, E = 120) and 0 below it. A lookup instead of integer
    passes over the bits: one gather ran 4.5x faster than nine passes."""
    index = torch.arange(1024, device=device)
    magnitude = _log_magnitude((index >> 1) & 0xFF, index & 1)
    return torch.where(index >= 512, 8 - magnitude, 8 + magnitude).to(torch.uint8)


def _log_magnitude(exponent: torch.Tensor, top_bit: torch.Tensor) -> torch.Tensor:
    """|code| of the log grid from a float's exponent bits E and mantissa top bit t: the
    rule of :func:`_log_code_table`, shared by the table and the compiled path."""
    return (exponent + top_bit - 120).clamp(1, 7) * (exponent >= 120)


def _log_offset_codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 [K, n] in [-1, 1] -> uint8 [K, n]: the log-grid codes plus 8. Eager: the table,
    one gather. Compiled: the table's rule as integer arithmetic, which fuses into the
    quantizer's loop, with the sign read from the float: compiled under
    ATEN_CPU_CAPABILITY=avx2, the sign bit taken through ``bits >> 22`` came out wrong
    (every negative value got a positive code), through the lookup and without it alike."""
    if torch.compiler.is_compiling():
        bits = scaled.view(torch.int32)
        magnitude = _log_magnitude((bits >> 23) & 0xFF, (bits >> 22) & 1)
        return torch.where(scaled < 0, 8 - magnitude, 8 + magnitude).to(torch.uint8)
    top_bits = (scaled.view(torch.int32) >> 22).bitwise_and_(0x3FF)
    return _log_code_table(scaled.device).index_select(0, top_bits.view(-1)).view(scaled.shape)


def _nibble_codes(code_bytes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 [K, n / 2] -> int32 codes [K, n/B, 2, B/2] (minus the offset 8), for compiled
    graphs: one broadcast shift for both halves compiles to one vectorised loop, where
    stacking the two halves compiled to a loop slower than eager."""
    shifts = torch.tensor([0, 4], dtype=torch.int32, device=code_bytes.device).view(1, 1, 2, 1)
    per_block = code_bytes.reshape(code_bytes.shape[0], -1, 1, fmt.block_size // 2).to(torch.int32)
    return ((per_block >> shifts) & 0xF) - 8


@functools.cache
def _log_pair_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: the two log-grid levels ``sign(c) * 2^(|c| - 7)`` (0 for c = 0) of
    one code byte, low nibble first, so dequantizing is one gather per byte."""
    codes = torch.arange(16, device=device) - 8
    levels = torch.where(codes == 0, 0.0, codes.sign() * torch.exp2(codes.abs() - 7.0))
    byte = torch.arange(256, device=device)
    return torch.stack([levels[byte & 0xF], levels[byte >> 4]], dim=1)


def _log_dequantize(code_bytes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, numel: int) -> torch.Tensor:
    """uint8 [K, n / 2] codes, fp32 [K, n / B] scales -> fp32 [K, n]. Eager: one gather per
    byte from the pair table; compiled: the levels computed, in one fused loop."""
    num_rows = code_bytes.shape[0]
    if torch.compiler.is_compiling():
        codes = _nibble_codes(code_bytes, fmt)
        magnitude = codes.abs()
        levels = torch.where(magnitude == 0, 0.0, codes.sign() * torch.exp2(magnitude - 7.0))
        return (levels.view(num_rows, -1, fmt.block_size) * scales.unsqueeze(-1)).view(num_rows, numel)
    pairs = _log_pair_table(code_bytes.device).index_select(0, code_bytes.reshape(-1).to(torch.int32))
    # byte j of a block holds elements j and j + B / 2: [K, n/B, B/2, pair] -> [K, n/B, pair, B/2]
    halves = pairs.view(num_rows, numel // fmt.block_size, fmt.block_size // 2, 2).transpose(-1, -2)
    values = halves.new_empty(halves.shape)  # contiguous: the product would keep the transposed strides
    return torch.mul(halves, scales.view(num_rows, -1, 1, 1), out=values).view(num_rows, numel)


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
    compiles, which takes seconds) where the native kernels do not cover it. Same codes as
    :func:`quantize`."""
    rows = values.reshape(-1, values.shape[-1]) if values.dim() > 1 else values.view(1, -1)
    packed = native.quantize(rows, fmt) if native.handles(rows, fmt) else _compiled_quantize_and_pack()(rows, fmt)
    return packed if values.dim() > 1 else packed.view(-1)


def dequantize(packed: torch.Tensor, fmt: BlockFormat, numel: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize`: packed [P] or [K, P] -> values [numel] or [K, numel].

    With ``out`` (contiguous, K * numel values of any float dtype) the values are computed
    in fp32 and rounded once into it, and ``out`` is returned."""
    rows = packed if packed.dim() > 1 else packed.view(1, -1)
    if native.handles(rows, fmt):
        values = native.dequantize(rows, fmt, numel, dtype, out)
        return values if out is not None or packed.dim() > 1 else values.view(-1)
    if out is not None:
        return out.copy_(dequantize(packed, fmt, numel).view(out.shape))
    num_rows = rows.shape[0]
    assert rows.shape[1] == fmt.packed_nbytes(numel), (rows.shape, numel)
    code_nbytes = fmt.code_nbytes(numel)
    code_bytes = rows[:, :code_nbytes]
    scales = rows[:, code_nbytes:].contiguous().view(torch.float32)  # [K, n/B]
    if fmt.grid == "log":
        values = _log_dequantize(code_bytes, scales, fmt, numel).to(dtype)
        return values if packed.dim() > 1 else values.view(-1)
    if fmt.bits == 8:
        codes = code_bytes.contiguous().view(torch.int8)
    elif fmt.bits in PLANE_BITS:
        codes = _unpack_planes(code_bytes, fmt, numel)
    elif fmt.bits == 4 and torch.compiler.is_compiling():
        codes = _nibble_codes(code_bytes, fmt).view(num_rows, numel)
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
    blocks = codes.view(num_rows, numel // fmt.block_size, fmt.block_size).float().mul_(scales.unsqueeze(-1))
    values = blocks.view(num_rows, numel).to(dtype)
    return values if packed.dim() > 1 else values.view(-1)


@functools.cache
def _compiled_dequantize():
    return torch.compile(dequantize, dynamic=False)


def dequantize_compiled(packed: torch.Tensor, fmt: BlockFormat, numel: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize` through ``torch.compile`` where the native kernels do not cover
    it; the same values."""
    if native.handles(packed, fmt):
        return dequantize(packed, fmt, numel, dtype)
    return _compiled_dequantize()(packed, fmt, numel, dtype)


def quantizer(compiled: bool):
    """The quantize function to use: compiled or eager, which produce the same codes."""
    return quantize_compiled if compiled else quantize


def dequantizer(compiled: bool):
    """The dequantize function to use: compiled or eager, which produce the same values.
    Compiled only where ATen's CPU kernels are AVX-512: compiled for AVX2, the 4-bit
    formats dequantized slower than eager (measured on [2, 888K] values)."""
    if compiled and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return dequantize_compiled
    return dequantize
