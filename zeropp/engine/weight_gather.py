"""How a unit's weights are gathered: plain, quantized (qwZ), or from the secondary
partition inside the hpZ group (hpZ), DESIGN.md sections 3-4.

qwZ quantizes the fp32 master shard once per optimizer step and reuses the packed shard
for every gather until the weights change. hpZ keeps, after a gather from the primary
shards, this rank's part of the hpZ group's split of the gathered buffer: the packed bytes
when qwZ is on (half the memory, and backward sees exactly the forward's weights), else
the compute-dtype values. Later gathers of the unit then stay inside the hpZ group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import Communicator
from ..config import ZeroConfig
from ..quantization import dequantize, quantizer
from ..sharding import FlatParam
from ..topology import Topology


@dataclass
class PendingGather:
    work: object | None
    packed: torch.Tensor | None  # [W * packed shard bytes] uint8 when qwZ is on
    from_primary: bool


class WeightGather:
    def __init__(self, config: ZeroConfig, topology: Topology, communicator: Communicator) -> None:
        self.config = config
        self.comm = communicator
        self.world = topology.group("world")
        self.hpz = topology.hpz_group(config.hpz_size) if config.hpz_size > 1 else None
        self.format = config.weight_format if config.quantized_weights else None
        self.quantize = quantizer(config.compile_quantization)

    def start(self, flat: FlatParam, phase: str) -> PendingGather:
        """Begin filling ``flat.full``; the caller has allocated its storage."""
        use_secondary = self.hpz is not None and flat.secondary is not None
        group = self.hpz if use_secondary else self.world
        payload = flat.secondary if use_secondary else self._primary_payload(flat)
        if self.format is None:
            work = self.comm.all_gather(flat.full_data, payload, group, phase, flat.name)
            return PendingGather(work, None, not use_secondary)
        packed = torch.empty(
            self.world.size * self.format.packed_nbytes(flat.shard_numel), dtype=torch.uint8, device=payload.device
        )
        work = self.comm.all_gather(packed, payload, group, phase, flat.name)
        return PendingGather(work, packed, not use_secondary)

    def finish(self, flat: FlatParam, pending: PendingGather) -> None:
        if pending.work is not None:
            pending.work.wait()
        if pending.packed is not None:
            rows = pending.packed.view(self.world.size, -1)  # one packed shard per rank
            # Dequantized in fp32; the copy rounds to the compute dtype in the same pass.
            flat.full_data.view(self.world.size, -1).copy_(dequantize(rows, self.format, flat.shard_numel))
        if self.hpz is not None and pending.from_primary:
            flat.secondary = self._secondary_part(pending.packed if pending.packed is not None else flat.full_data)

    def quantization_error_sums(self, flats: list[FlatParam]) -> tuple[float, float]:
        """(sum of squared errors, sum of squares) of this rank's quantized master shards
        against the masters: what the qwZ gather hands out, before compute-dtype rounding."""
        error, norm = 0.0, 0.0
        if self.format is None:
            return error, norm
        for flat in flats:
            master = flat.master.detach()
            restored = dequantize(self._primary_payload(flat), self.format, flat.shard_numel)
            error += (restored - master).pow(2).sum().item()
            norm += master.pow(2).sum().item()
        return error, norm

    def _primary_payload(self, flat: FlatParam) -> torch.Tensor:
        if self.format is None:
            return flat.compute_shard()
        if flat.packed_shard is None:
            flat.packed_shard = self.quantize(flat.master.detach(), self.format)
        return flat.packed_shard

    def _secondary_part(self, gathered: torch.Tensor) -> torch.Tensor:
        """Member j of the hpZ group keeps part j of ``gathered`` split in hpz_size parts."""
        member = self.hpz.ranks.index(self.comm.comm_log.rank)
        part = gathered.numel() // self.hpz.size
        return gathered[member * part : (member + 1) * part].clone()
