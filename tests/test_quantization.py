"""The block quantizer's fast paths (native CPU kernels, torch, compiled torch) against the
one-block-at-a-time specification."""

import os
import shutil

import pytest
import torch

from zeropp.quantization import BlockFormat, dequantize, native, quantize
from zeropp.quantization.blocks import dequantize_compiled, quantize_compiled
from zeropp.quantization.reference import reference_dequantize, reference_quantize


def require_native_kernels():
    if os.environ.get("ZEROPP_NATIVE_KERNELS") == "0":
        pytest.skip("native kernels switched off by ZEROPP_NATIVE_KERNELS=0")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine: the torch path is the one in use")
    assert native.available(), "a C compiler is here, so the native kernels must build"


@pytest.fixture(params=["native", "torch"])
def path(request):
    """Run the test once through the native kernels and once through the torch path."""
    if request.param == "torch":
        with native.torch_path_only():
            yield request.param
        return
    require_native_kernels()
    yield request.param


def sample(numel, seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * torch.logspace(-3, 1, numel)
    values[:32] = 0.0  # an all-zero block
    return values


FORMATS = [(2, "uniform"), (3, "uniform"), (4, "uniform"), (8, "uniform"), (12, "uniform"), (4, "log")]


@pytest.mark.parametrize("bits,grid", FORMATS)
@pytest.mark.parametrize("block_size", [32, 64])
def test_fast_path_produces_the_reference_codes(bits, grid, block_size, path):
    fmt = BlockFormat(bits, block_size, grid)
    values = sample(block_size * 12)
    packed = quantize(values, fmt)
    assert packed.dtype == torch.uint8 and packed.numel() == fmt.packed_nbytes(values.numel())
    assert torch.equal(packed, reference_quantize(values, fmt))
    assert torch.equal(dequantize(packed, fmt, values.numel()), reference_dequantize(packed, fmt, values.numel()))
    assert torch.equal(values, sample(block_size * 12))  # the kernel works in place on its own copy only


def test_log_grid_codes_at_the_midpoints_between_levels(path):
    # Every midpoint between two levels (2^-7 and 1.5 * 2^(k-8)), one float below and above,
    # both signs, with absmax 1 so the scaled values are these exactly.
    midpoints = torch.tensor([2.0**-7] + [1.5 * 2.0 ** (k - 8) for k in range(2, 8)])
    below = torch.nextafter(midpoints, torch.zeros_like(midpoints))
    above = torch.nextafter(midpoints, torch.ones_like(midpoints))
    values = torch.cat([midpoints, below, above, torch.tensor([1.0, 0.0, -0.0, 2.0**-9])])
    values = torch.cat([values, -values])
    values = torch.cat([values, torch.zeros(64 - values.numel() % 64)])
    fmt = BlockFormat(4, 64, "log")
    assert torch.equal(quantize(values, fmt), reference_quantize(values, fmt))


@pytest.mark.parametrize("bits", [2, 3, 4, 8, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_within_half_a_step_per_block(bits, dtype, path):
    fmt = BlockFormat(bits, 64)
    values = sample(64 * 20, seed=1).to(dtype)
    restored = dequantize(quantize(values, fmt), fmt, values.numel())
    blocks = values.float().view(-1, 64)
    # Half a quantization step, plus fp32 rounding of x / scale and q * scale: a few units
    # in the last place of a code as large as max_code.
    half_step = blocks.abs().amax(dim=1, keepdim=True) / fmt.max_code / 2
    assert ((restored.view(-1, 64) - blocks).abs() <= half_step * (1 + 4 * fmt.max_code * 2**-24)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_grid_keeps_every_value_within_a_third(dtype, path):
    fmt = BlockFormat(4, 64, "log")
    values = sample(64 * 20, seed=2).to(dtype)
    restored = dequantize(quantize(values, fmt), fmt, values.numel()).view(-1, 64)
    blocks = values.float().view(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    # Between two levels a factor 2 apart the midpoint is 3/2 of the lower one, so the
    # nearest level is off by at most a third of the value; under the smallest level,
    # absmax / 64, by at most half of it. (A uniform 4-bit grid zeroes everything below
    # absmax / 14.)
    bound = torch.maximum(blocks.abs() / 3, absmax / 128) * (1 + 2**-20)
    assert ((restored - blocks).abs() <= bound).all()
    assert torch.equal(restored.sign() * (blocks.abs() >= absmax / 128), blocks.sign() * (blocks.abs() >= absmax / 128))


def test_rows_are_independent_segments(path):
    fmt = BlockFormat(4, 32)
    rows = sample(32 * 6).view(3, 64)
    packed = quantize(rows, fmt)
    for row in range(3):
        assert torch.equal(packed[row], quantize(rows[row], fmt))
    assert torch.equal(dequantize(packed, fmt, 64), torch.stack([dequantize(p, fmt, 64) for p in packed]))


@pytest.mark.parametrize(
    "kwargs,field",
    [(dict(bits=5), "bits"), (dict(block_size=7), "block_size"), (dict(bits=2, block_size=20), "block_size"), (dict(grid="cubic"), "grid"),
     (dict(bits=8, grid="log"), "bits")],
)
def test_bad_formats_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BlockFormat(**kwargs)


@pytest.mark.parametrize("bits,grid", FORMATS)
def test_compiled_fast_path_produces_the_reference_codes(bits, grid):
    fmt = BlockFormat(bits, 64, grid)
    values = sample(64 * 16, seed=3)
    with native.torch_path_only():  # the compiled torch path, which CUDA tensors take
        packed = quantize_compiled(values, fmt)
        restored = dequantize_compiled(packed, fmt, values.numel())
    assert torch.equal(packed, reference_quantize(values, fmt))
    assert torch.equal(restored, reference_dequantize(packed, fmt, values.numel()))


NATIVE_FORMATS = [BlockFormat(8, 256), BlockFormat(4, 256), BlockFormat(4, 256, "log"), BlockFormat(12, 256)]


@pytest.mark.parametrize("fmt", NATIVE_FORMATS, ids=["int8", "int4", "log4", "int12"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_kernels_equal_the_torch_path_on_large_rows(fmt, dtype, threads):
    """Rows large enough for the kernels to split blocks over threads, bf16 input, ties:
    every code, scale and restored value equals the torch path's."""
    require_native_kernels()
    values = (sample(3 * 2048 * 256, seed=4) * 0.37).view(3, -1).to(dtype)
    values[1, 256:512] = torch.arange(256) - 127.5  # x * inverse lands on k + 0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = quantize(values, fmt)
        restored = {out_dtype: dequantize(packed, fmt, values.shape[1], out_dtype)
                    for out_dtype in (torch.float32, torch.bfloat16, torch.float16)}
    finally:
        torch.set_num_threads(previous)
    with native.torch_path_only():
        assert torch.equal(packed, quantize(values, fmt))
        for out_dtype, native_values in restored.items():
            assert torch.equal(native_values, dequantize(packed, fmt, values.shape[1], out_dtype)), out_dtype


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_out_rounds_once(out_dtype, path):
    fmt = BlockFormat(8, 64)
    values = sample(64 * 8, seed=5).view(2, -1)
    packed = quantize(values, fmt)
    out = torch.full((2, 256), float("nan"), dtype=out_dtype)
    returned = dequantize(packed, fmt, 256, out=out)
    assert returned is out
    expected = torch.stack([reference_dequantize(row, fmt, 256) for row in packed]).to(out_dtype)
    assert torch.equal(out, expected)


def test_native_kernels_keep_a_nonfinite_block_visible():
    """A NaN or inf in a block shows up in that block's scale, whichever path runs."""
    fmt = BlockFormat(8, 64)
    values = sample(64 * 4, seed=6)
    values[70], values[200] = float("nan"), float("inf")
    packed = quantize(values, fmt)
    scales = packed[fmt.code_nbytes(values.numel()):].clone().view(torch.float32)
    assert torch.isfinite(scales).tolist() == [True, False, True, False]


def test_formats_beyond_the_native_kernels_take_the_torch_path():
    assert not native.handles(torch.zeros(8192), BlockFormat(8, 8192))
    assert not native.handles(torch.zeros(64), BlockFormat(3, 64))
    assert native.handles(torch.zeros(64), BlockFormat(4, 64, "log")) == native.available()
