"""A CPU stand-in for DeepSpeed's CUDA quantizer op (``QuantizerBuilder().load()``).

DeepSpeed's qwZ and qgZ call a CUDA-only extension; on a CPU build loading it fails with
"This op had not been implemented on CPU backend". This module implements the four
functions those paths use with the same arithmetic, written here in PyTorch:

- symmetric group quantization: ``scale = 2**bits / (2 * absmax)``, ``code = round(x * scale)``
  clamped to the signed range, and the stored parameter is ``1 / scale``;
- 4-bit codes are packed two per byte;
- ``swizzle_quant`` reorders the flat gradient so the intra-node all-to-all sends each local
  rank the partitions of every node that it will own, then quantizes;
- ``quantized_reduction`` dequantizes the ``devices_per_node`` received pieces, sums them and
  re-quantizes for the inter-node hop.

Message sizes equal the CUDA op's (codes of the same width, one fp32 scale per group), so
the bytes DeepSpeed sends are the real ones; only the kernels' speed differs.
"""

from __future__ import annotations

import torch

SYMMETRIC = 0


def _quantize(values: torch.Tensor, groups: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values: any shape, numel divisible by groups -> (int8 codes [numel] or packed [numel/2], scales [groups]).

    The CUDA op returns scales shaped [groups, 1]; they are flat here because gloo's
    all_gather_into_tensor, unlike NCCL's, insists that input and output shapes line up."""
    grouped = values.reshape(groups, -1).float()
    absmax = grouped.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, (1 << bits) / (2 * absmax), torch.ones_like(absmax))
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.clamp(torch.round(grouped * scale), low, high).to(torch.int8).reshape(-1)
    if bits == 4:
        pairs = codes.reshape(-1, 2)
        codes = ((pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)).to(torch.int8)
    return codes, (1.0 / scale).reshape(-1)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """Inverse of ``_quantize``; returns fp32 values, flat."""
    codes = codes.reshape(-1)
    if bits == 4:
        low = (codes << 4) >> 4  # sign-extend the low nibble
        high = codes >> 4
        codes = torch.stack((low, high), dim=1).reshape(-1)
    return (codes.float().reshape(groups, -1) * scales.reshape(groups, 1).float()).reshape(-1)


class StandInQuantizer:
    """The subset of DeepSpeed's quantizer op that ZeRO++ calls."""

    Symmetric = SYMMETRIC

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}  # reported with the results: shows qwZ and qgZ really ran

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def quantize(self, values, groups, bits, quant_type):
        self._count("quantize")
        codes, scales = _quantize(values, groups, bits)
        return codes.reshape(*values.shape[:-1], -1), scales

    def dequantize(self, codes, scales, groups, bits, quant_type):
        self._count("dequantize")
        values = _dequantize(codes, scales, groups, bits)
        return values.reshape(*codes.shape[:-1], -1).to(torch.half)

    def swizzle_quant(self, values, groups, bits, quant_type, pipeline_size, nodes, devices_per_node):
        self._count("swizzle_quant")
        # [nodes, devices_per_node, partition] -> [devices_per_node, nodes, partition]: the chunk
        # for local rank d holds partitions d, d + devices_per_node, ... (one per node).
        swizzled = values.reshape(pipeline_size, nodes, devices_per_node, -1).transpose(1, 2).reshape(-1)
        return _quantize(swizzled, groups, bits)

    def quantized_reduction(self, codes, scales, in_groups, out_groups, bits, quant_type, devices_per_node):
        self._count("quantized_reduction")
        # codes: devices_per_node pieces, one from each local rank, each in_groups / devices_per_node groups.
        received = _dequantize(codes, scales, in_groups, bits).reshape(devices_per_node, -1)
        return _quantize(received.sum(dim=0), out_groups, bits)


def install() -> StandInQuantizer:
    """Make DeepSpeed's qwZ and qgZ paths use the stand-in instead of loading the CUDA op."""
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import partition_parameters

    quantizer = StandInQuantizer()
    coalesced_collectives.quantizer_module = quantizer
    partition_parameters.CUDAQuantizer.quantizer_cuda_module = quantizer
    return quantizer
