"""Figures about a wrapped model that training loops and benchmarks report: the bytes a
step should move, and how far the quantized weights are from the masters."""

from __future__ import annotations

import torch

from ..accounting import FlatSummary, predicted_step_bytes


def flat_summaries(model) -> list[FlatSummary]:
    """What the analytic byte model needs to know of ``model``'s flat buffers."""
    return [FlatSummary(unit.is_root, flat.requires_grad, flat.shard_numel) for unit in model.units for flat in unit.flats]


def predicted_bytes(model, accumulation: int = 1, node_accumulation: bool = False) -> dict[str, dict[str, int]]:
    """The analytic bytes ``model``'s rank receives per optimizer step of ``accumulation``
    micro-steps, per phase, intra and inter node."""
    flats = flat_summaries(model)
    native = model.communicator.native_reduce_scatter(model.topology.group("world"), model.topology.device)
    backend = "nccl" if native else "gloo"
    return predicted_step_bytes(flats, model.topology.layout, model.active_config, model.topology.rank, backend,
                                accumulation, node_accumulation)


@torch.no_grad()
def weight_quantization_error(model) -> float | None:
    """Relative L2 error of the gathered weights against the fp32 masters over the whole
    model (collective); None when the gather quantizes nothing."""
    config = model.active_config
    if not (config.quantized_weights or config.quantized_nontrainable_weights or config.weight_deltas):
        return None
    sums = torch.tensor(model.weight_gather.quantization_error_sums(model.flat_params()), dtype=torch.float64,
                        device=model.topology.device)
    model.communicator.all_reduce_sum(sums, model.topology.group("world"), "metrics")
    return (sums[0] / sums[1]).sqrt().item()
