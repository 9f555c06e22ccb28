"""Symmetric block quantization (INT8 and packed INT4) with fp32 per-block scales."""

from .blocks import BlockFormat, dequantize, dequantizer, quantize, quantizer

__all__ = ["BlockFormat", "dequantize", "dequantizer", "quantize", "quantizer"]
