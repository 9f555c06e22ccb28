"""``zeropp bench quant``: speed of block quantization against a plain copy, and its error
against one scale per tensor on the example GPT's real weights and gradients.

    zeropp bench quant --out runs/quant.json

Throughput is a ratio to ``copy_`` of the same fp32 tensor, measured side by side
(alternating, median of repeats) so the shared machine's noise hits both alike.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from zeropp.data import ByteCorpus, load_stdlib_corpus
from zeropp.models import GPT, GPTConfig
from zeropp.quantization import BlockFormat, dequantize, native, quantize
from zeropp.quantization.blocks import _compiled_quantize_blocks, quantize_compiled
from zeropp_tools.bench.provenance import provenance

logger = logging.getLogger(__name__)


def _seconds(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _torch_path(fn):
    """``fn`` run on the torch path (the one CUDA tensors and machines without a compiler take)."""
    def run():
        with native.torch_path_only():
            return fn()
    return run


def throughput(numel: int, repeats: int = 30) -> dict:
    values = torch.randn(numel)
    target = torch.empty_like(values)
    result = {"numel": numel, "threads": torch.get_num_threads(), "native_kernels": native.available()}
    for bits in (8, 4):
        fmt = BlockFormat(bits, 256)
        rows = values.view(1, -1)
        kernel = _compiled_quantize_blocks()
        packed = quantize(values, fmt)
        restored = torch.empty_like(values)
        paths = {"copy": lambda: target.copy_(values), "native": lambda: quantize(values, fmt),
                 "native_dequantize": lambda: dequantize(packed, fmt, numel, out=restored),
                 "eager": _torch_path(lambda: quantize(values, fmt)),
                 "compiled": _torch_path(lambda: quantize_compiled(values, fmt)),
                 "compiled_kernel": lambda: kernel(rows, fmt)}
        for fn in paths.values():
            fn(), fn()  # warm-up (and compilation)
        samples = {name: [] for name in paths}
        for _ in range(repeats):  # interleave so noise hits every path alike
            for name, fn in paths.items():
                samples[name] += _seconds(fn, 1)
        medians = {name: statistics.median(times) for name, times in samples.items()}
        result[f"int{bits}"] = {
            "copy_GBps": values.numel() * 8 / medians["copy"] / 1e9,  # read + write fp32
            **{f"{name}_vs_copy": medians["copy"] / medians[name] for name in paths if name != "copy"},
            "paths_equal": bool(torch.equal(packed, _torch_path(lambda: quantize(values, fmt))())
                                and torch.equal(packed, _torch_path(lambda: quantize_compiled(values, fmt))())),
        }
    return result


def gpt_tensors(steps: int = 30) -> tuple[dict, dict]:
    """Weights and gradients of the GPT after ``steps`` AdamW steps on the corpus."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = ByteCorpus(load_stdlib_corpus(max_bytes=4_000_000))
    for step in range(steps):
        inputs, targets = corpus.global_batch("train", step, 8, 128)
        optimizer.zero_grad()
        model(inputs, targets).backward()
        optimizer.step()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return weights, grads


def relative_error(tensors: dict, bits: int, block_size: int | None) -> float:
    """||Q(x) - x|| / ||x|| over all tensors; ``block_size=None`` means one scale per tensor."""
    error, norm = 0.0, 0.0
    for value in tensors.values():
        flat = value.reshape(-1).float()
        size = block_size or flat.numel() + flat.numel() % 2
        padded = torch.nn.functional.pad(flat, (0, -flat.numel() % size))
        fmt = BlockFormat(bits, size)
        restored = dequantize(quantize(padded, fmt), fmt, padded.numel())[: flat.numel()]
        error += (restored - flat).pow(2).sum().item()
        norm += flat.pow(2).sum().item()
    return (error / norm) ** 0.5


def accuracy() -> dict:
    weights, grads = gpt_tensors()
    result = {}
    for kind, tensors in (("weights", weights), ("gradients", grads)):
        for bits in (8, 4):
            per_tensor = relative_error(tensors, bits, None)
            block = relative_error(tensors, bits, 256)
            result[f"{kind}_int{bits}"] = {
                "per_tensor_relative_error": per_tensor,
                "block256_relative_error": block,
                "improvement": per_tensor / block,
            }
    return result


TARGET_VS_COPY = 0.8  # quantize and pack at >= 0.8x the speed of copying the fp32 input


def main(args) -> int:
    report = {"provenance": provenance(), "throughput": {}, "accuracy": accuracy()}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        report["throughput"][f"threads_{threads}"] = throughput(args.numel)
    report["native_meets_target"] = all(row[bits]["native_vs_copy"] >= TARGET_VS_COPY
                                        for row in report["throughput"].values() for bits in ("int8", "int4"))
    for threads, measured in report["throughput"].items():
        for bits in ("int8", "int4"):
            row = measured[bits]
            logger.info(f"{threads} {bits}: copy {row['copy_GBps']:.2f} GB/s; quantize and pack, native "
                        f"{row['native_vs_copy']:.2f}x of copy, torch eager {row['eager_vs_copy']:.2f}x, torch "
                        f"compiled {row['compiled_vs_copy']:.2f}x (kernel alone {row['compiled_kernel_vs_copy']:.2f}x); "
                        f"native dequantize {row['native_dequantize_vs_copy']:.2f}x; same codes: {row['paths_equal']}")
    for name, row in report["accuracy"].items():
        logger.info(f"{name}: relative error per-tensor {row['per_tensor_relative_error']:.4f}, "
              f"block-256 {row['block256_relative_error']:.4f} ({row['improvement']:.1f}x lower)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info(f"wrote {args.out}")
    return 0
