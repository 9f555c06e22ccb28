"""qwZ: the weight all-gather carries block-quantized codes and fp32 scales instead of
compute-dtype values (docs/design.md section 4.2).

Each rank quantizes its fp32 master shard once per optimizer step and reuses the packed
shard for every gather until the weights change; codes and scales travel in one buffer.
"""

from __future__ import annotations

import torch

from .. import traffic
from ..traffic import Traffic
from ..quantization import dequantize, quantizer
from ..topology import Layout
from .base import WeightGather


class PackedShards:
    """The packed (quantized) master shard of each flat parameter, made on first use and
    kept until the engine says the master changed (never, for frozen parameters, unless
    they are loaded or edited)."""

    def __init__(self, config) -> None:
        self.format = config.weight_format
        self.quantize = quantizer(config.compile_quantization)
        self._packed: dict[str, torch.Tensor] = {}  # flat name -> uint8 [packed shard bytes]

    def get(self, flat) -> torch.Tensor:
        if flat.name not in self._packed:
            self._packed[flat.name] = self.quantize(flat.master.detach(), self.format)
        return self._packed[flat.name]

    def invalidate(self, flat) -> None:
        self._packed.pop(flat.name, None)

    def kept(self) -> list[torch.Tensor]:
        return list(self._packed.values())

    def error_sums(self, flats) -> tuple[float, float]:
        """(sum of squared errors, sum of squares) of the masters as the next gather will pack
        them. Packed afresh and not kept: the cache may still hold the codes of the weights
        before an optimizer step, and filling it here would take work out of the next step."""
        error, norm = 0.0, 0.0
        for flat in flats:
            master = flat.master.detach()
            restored = dequantize(self.quantize(master, self.format), self.format, flat.shard_numel)
            error += (restored - master).pow(2).sum().item()
            norm += master.pow(2).sum().item()
        return error, norm


class QuantizedGather(WeightGather):
    def __init__(self, config, topology=None, communicator=None) -> None:
        super().__init__(config, topology, communicator)
        self.format = config.weight_format
        self.packed = PackedShards(config)

    def start(self, flat, phase: str):
        payload = self.packed.get(flat)
        gathered = payload.new_empty(self._world().size * payload.numel())  # [W * packed shard bytes]
        return self.comm.all_gather(gathered, payload, self._world(), phase, flat.name), gathered

    def finish(self, flat, pending) -> torch.Tensor:
        work, gathered = pending
        self._wait(work)
        self.fill_from_packed(flat, gathered)
        return gathered

    @property
    def keeps_packed(self) -> bool:
        return True

    def fill_from_packed(self, flat, gathered: torch.Tensor) -> None:
        """Dequantize W packed shards [W * P] into ``flat.full_data``."""
        rows = gathered.view(self.topology.world_size, -1)  # one packed shard per rank
        # Dequantized in fp32 and rounded once to the compute dtype.
        dequantize(rows, self.format, flat.shard_numel, out=flat.full_data.view(self.topology.world_size, -1))

    def invalidate(self, flat) -> None:
        self.packed.invalidate(flat)

    def kept_tensors(self) -> list[torch.Tensor]:
        return self.packed.kept()

    def quantization_error_sums(self, flats) -> tuple[float, float]:
        return self.packed.error_sums(flats)

    def kept_bytes(self, shard_numel: int, layout: Layout) -> int:
        return self.chunk_bytes(shard_numel)  # this rank's packed shard

    def receive_bytes(self, shard_numel: int, layout: Layout) -> int:
        return layout.world_size * self.chunk_bytes(shard_numel)  # every rank's packed shard

    def chunk_bytes(self, shard_numel: int) -> int:
        return self.format.packed_nbytes(shard_numel)

    def predicted_bytes(self, shard_numel: int, layout: Layout, rank: int, phase: str) -> Traffic:
        return traffic.ring(layout, rank, traffic.world(layout), self.chunk_bytes(shard_numel))

    def collective_steps(self, layout: Layout, phase: str) -> int:
        return layout.world_size - 1
