"""The CPU stand-in for DeepSpeed's quantizer op (benchmarks/deepspeed_quantizer.py) computes
what DeepSpeed's qwZ and qgZ expect, so the side-by-side DeepSpeed numbers are honest. The
test replays DeepSpeed's all_to_all_quant_reduce for 2 nodes x 2 ranks in one process."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from deepspeed_quantizer import StandInQuantizer  # noqa: E402

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def test_weight_quantization_matches_deepspeeds_arithmetic():
    quantizer = StandInQuantizer()
    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    codes, scales = quantizer.quantize(values, 8, 8, quantizer.Symmetric)
    assert codes.dtype == torch.int8 and codes.numel() == values.numel() and scales.numel() == 8
    grouped = values.reshape(8, -1)
    absmax = grouped.abs().amax(dim=1, keepdim=True)
    assert torch.allclose(scales.reshape(8, 1), absmax / 128)  # DeepSpeed stores 1 / (256 / (2 absmax))
    restored = quantizer.dequantize(codes, scales, 8, 8, quantizer.Symmetric).float().reshape(8, -1)
    error = (restored - grouped).abs() / scales.reshape(8, 1)  # in steps
    # Round to nearest, except values that round to code 128 (the positive extreme and its
    # neighbours within half a step), clamped to 127 as in DeepSpeed's kernel: up to one step
    # off. The fp16 output adds up to 0.07 steps.
    clamped = grouped * 128 / absmax >= 127.5
    assert (error[~clamped] <= 0.6).all() and (error[clamped] <= 1.1).all()


def _deepspeed_two_hop(inputs: list[torch.Tensor], quantizer: StandInQuantizer) -> list[torch.Tensor]:
    """DeepSpeed's all_to_all_quant_reduce with the all-to-alls done by hand."""
    intra_groups = max(inputs[0].shape[0], inputs[0].shape[1], WORLD)
    inter_groups = intra_groups // PER_NODE
    sent = [quantizer.swizzle_quant(x, intra_groups, 4, quantizer.Symmetric, 1, NODES, PER_NODE) for x in inputs]
    reduced = {}
    for rank in range(WORLD):  # intra-node all-to-all: local rank l gets chunk l of each local peer
        node, local = divmod(rank, PER_NODE)
        peers = [sent[node * PER_NODE + peer] for peer in range(PER_NODE)]
        codes = torch.cat([c.chunk(PER_NODE)[local] for c, _ in peers])
        scales = torch.cat([s.chunk(PER_NODE)[local] for _, s in peers])
        reduced[rank] = quantizer.quantized_reduction(codes, scales, intra_groups, inter_groups, 4,
                                                      quantizer.Symmetric, PER_NODE)
    outputs = []
    for rank in range(WORLD):  # inter-node all-to-all among ranks with the same local index
        node, local = divmod(rank, PER_NODE)
        peers = [reduced[other * PER_NODE + local] for other in range(NODES)]
        codes = torch.cat([c.chunk(NODES)[node] for c, _ in peers])
        scales = torch.cat([s.chunk(NODES)[node] for _, s in peers])
        final = quantizer.dequantize(codes, scales, scales.numel(), 4, quantizer.Symmetric).float()
        outputs.append(sum(final.chunk(NODES)) / NODES)
    return outputs


def test_two_hop_reduction_gives_each_rank_its_own_partition():
    torch.manual_seed(0)
    quantizer = StandInQuantizer()
    signal = torch.randn(32, 64)
    inputs = [signal + 0.1 * torch.randn(32, 64) for _ in range(WORLD)]
    outputs = _deepspeed_two_hop(inputs, quantizer)
    exact = (sum(inputs) / NODES).reshape(-1).chunk(WORLD)  # DeepSpeed divides by the node count only
    for rank in range(WORLD):
        error = (outputs[rank] - exact[rank]).norm() / exact[rank].norm()
        assert error < 0.25, f"rank {rank}: relative error {error:.3f}"  # two INT4 hops
        wrong = (outputs[rank] - exact[(rank + 1) % WORLD]).norm() / exact[rank].norm()
        assert wrong > 0.5  # a mixed-up partition order would land here
    assert quantizer.calls == {"swizzle_quant": WORLD, "quantized_reduction": WORLD, "dequantize": WORLD}
