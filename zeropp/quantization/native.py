"""Native CPU kernels for the common formats (uniform INT8 / INT4 / INT12, log-grid INT4).

``native_kernels.c`` is compiled once per machine with the system C compiler into a cache
directory and called through ``ctypes``; the torch path in ``blocks.py`` stays the
fallback (no compiler, CUDA tensors, other formats) and the tests hold both to
``reference.py``. Set ``ZEROPP_NATIVE_KERNELS=0`` to use the torch path only.

Why native: the torch path makes one pass over memory per operation (absmax, multiply,
round, convert, pack) and reached 0.4-0.6x of a memory copy; one pass per block, with the
block in L1, runs at copy speed or better.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .blocks import BlockFormat

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native_kernels.c")
_FORMATS = {(8, "uniform"): 0, (4, "uniform"): 1, (4, "log"): 2, (12, "uniform"): 3}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# False within `torch_path_only()`, with which the tests hold the torch path (CUDA's) to
# the reference as well.
_ENABLED = contextvars.ContextVar("zeropp_native_kernels_enabled", default=True)
# -ffp-contract=off: a fused multiply-add would round x * inverse + 1.5 * 2^23 once, not
# twice as torch does, and move ties (x * inverse = k + 0.5) to the other code.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: a library built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_directory() -> Path:
    root = os.environ.get("ZEROPP_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "zeropp" / "native"


def _compile(target: Path) -> None:
    compiler = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks may build at once: each writes its own file, the rename is atomic.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as scratch:
        scratch_path = Path(scratch.name)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(scratch_path)], check=True,
                       capture_output=True, text=True, timeout=120)
        scratch_path.replace(target)
    finally:
        scratch_path.unlink(missing_ok=True)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ZEROPP_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        source = _SOURCE.read_bytes()
        key = hashlib.sha256(source + " ".join(_FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
        target = _cache_directory() / f"zeropp_quantization_{key}.so"
        if not target.exists():
            _compile(target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:  # RuntimeError: no home folder
        detail = getattr(error, "stderr", "") or error
        logger.warning("native quantization kernels unavailable, using the torch path: %s", detail)
        return None
    signature = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3
    for function in (library.zeropp_quantize, library.zeropp_dequantize):
        function.argtypes, function.restype = signature, ctypes.c_int
    return library


@contextlib.contextmanager
def torch_path_only():
    """Within this block every call takes the torch path, as on a machine without a compiler."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def available() -> bool:
    """Whether the native kernels are built and loadable on this machine."""
    return _library() is not None


def handles(tensor: torch.Tensor, fmt: BlockFormat) -> bool:
    """Whether the native kernels cover this tensor's device and this format."""
    return (tensor.device.type == "cpu" and (fmt.bits, fmt.grid) in _FORMATS and fmt.block_size <= 4096
            and not torch.compiler.is_compiling() and _ENABLED.get() and available())


def quantize(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``rows`` [K, n] on CPU -> packed uint8 [K, P], the layout of ``blocks.pack``."""
    if rows.dtype not in _DTYPES:
        rows = rows.float()
    rows = rows.contiguous()
    num_rows, numel = rows.shape
    packed = torch.empty(num_rows, fmt.packed_nbytes(numel), dtype=torch.uint8, device=rows.device)
    status = _library().zeropp_quantize(rows.data_ptr(), packed.data_ptr(), num_rows, numel, fmt.block_size,
                                        packed.shape[1], _FORMATS[fmt.bits, fmt.grid], _DTYPES[rows.dtype],
                                        torch.get_num_threads())
    assert status == 0, f"native quantize rejected {tuple(rows.shape)} in {fmt}"
    return packed


def dequantize(packed: torch.Tensor, fmt: BlockFormat, numel: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """packed uint8 [K, P] on CPU -> values [K, numel] in ``dtype``, written into ``out``
    when given (contiguous, that shape and dtype)."""
    packed = packed.contiguous()
    num_rows = packed.shape[0]
    target_dtype = dtype if dtype in _DTYPES else torch.float32
    values = out if out is not None and out.dtype in _DTYPES and out.is_contiguous() else torch.empty(
        num_rows, numel, dtype=target_dtype, device=packed.device)
    assert values.is_contiguous() and values.numel() == num_rows * numel, (values.shape, num_rows, numel)
    status = _library().zeropp_dequantize(packed.data_ptr(), values.data_ptr(), num_rows, numel, fmt.block_size,
                                          packed.shape[1], _FORMATS[fmt.bits, fmt.grid], _DTYPES[values.dtype],
                                          torch.get_num_threads())
    assert status == 0, f"native dequantize rejected {tuple(packed.shape)} in {fmt}"
    if out is not None:
        return out if values is out else out.copy_(values.view(out.shape))
    return values.to(dtype)
