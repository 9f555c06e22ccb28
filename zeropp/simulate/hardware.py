"""Hardware as the simulator sees it: a GPU's (or CPU rank's) compute, a node's links, the
collectives' latencies and the kernels around quantized payloads. Each description is a
JSON file in ``zeropp/simulate/hardware/`` that names the source of every number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

HARDWARE_FOLDER = Path(__file__).with_name("hardware")


@dataclass(frozen=True)
class Hardware:
    name: str
    # Compute: the FLOP/s one rank sustains on a transformer's matrix products once they
    # fill the device, and the share of it left while a collective runs beside (NCCL's
    # kernels hold streaming multiprocessors; gloo's threads hold cores).
    sustained_flops: float
    slowdown_during_communication: float
    # Wave quantization (0 streaming processors: none): a product of M tokens by N outputs
    # runs ceil(tiles / processors) full waves of tile_m x tile_n tiles.
    processors: int
    tile_m: int
    tile_n: int
    # Links, each direction: a rank's intra-node link and a node's network adapters.
    intra_node_bytes_per_s: float
    network_adapters_per_node: int
    adapter_bytes_per_s: float
    link_efficiency: float  # share of line rate a large collective reaches
    # What the adapters carry in, as adapter_bytes_per_s does, when every rank of the node
    # runs its own copy of a collective across nodes at once (several flows share the
    # link: TCP through a shaper carries less than one flow does). 0: the same rate.
    parallel_flows_adapter_bytes_per_s: float
    # Latency of a collective: a base plus one step per ring hop (NCCL's tuning model).
    base_latency_s: float
    intra_node_step_latency_s: float
    inter_node_step_latency_s: float
    # Ranks drift apart while they compute, so a collective issued after compute starts
    # this much later, when the slowest rank arrives. A wait that stalls lines the ranks up
    # again: a collective issued right after one starts on time.
    arrival_skew_s: float
    # Host time on the compute stream per byte a rank receives, as a rate (0: none). gloo
    # over TCP copies every byte on the cores that compute; NCCL's copies run on the GPU,
    # where their cost is the slowdown above.
    host_receive_intra_node_bytes_per_s: float
    host_receive_inter_node_bytes_per_s: float
    # Memory-bound kernels: quantize/dequantize around int8/int4 payloads, the optimizer.
    kernel_bytes_per_s: float
    optimizer_bytes_per_parameter: int
    sources: dict[str, str]

    @property
    def inter_node_bytes_per_s(self) -> float:
        """What one node's adapters carry in, together, at the efficiency collectives reach."""
        return self.network_adapters_per_node * self.adapter_bytes_per_s * self.link_efficiency

    def inter_node_rate(self, copies_per_node: int) -> float:
        """What one node's adapters carry in while ``copies_per_node`` copies of a
        collective (one per rank of the node) cross nodes at once."""
        if copies_per_node > 1 and self.parallel_flows_adapter_bytes_per_s > 0:
            return self.network_adapters_per_node * self.parallel_flows_adapter_bytes_per_s * self.link_efficiency
        return self.inter_node_bytes_per_s

    def with_adapters(self, count: int, bytes_per_s: float | None = None,
                      parallel_flows_bytes_per_s: float | None = None) -> Hardware:
        """The same nodes with ``count`` network adapters (of ``bytes_per_s`` each, and
        ``parallel_flows_bytes_per_s`` with several flows, if given; else the single-flow rate)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(network_adapters_per_node=count,
                      adapter_bytes_per_s=self.adapter_bytes_per_s if bytes_per_s is None else bytes_per_s)
        if bytes_per_s is not None or parallel_flows_bytes_per_s is not None:
            values["parallel_flows_adapter_bytes_per_s"] = parallel_flows_bytes_per_s or 0.0
        return Hardware(**values)

    def matmul_seconds(self, flops: float, tokens: int, parameters: int) -> float:
        """Seconds of a unit's products of ``tokens`` rows with its ``parameters`` weights."""
        return flops / (self.sustained_flops * self.wave_efficiency(tokens, parameters))

    def wave_efficiency(self, tokens: int, parameters: int) -> float:
        """Share of full waves in a transformer block's four products (QKV, projection,
        MLP up and down: N = 3h, h, 4h, h, weighted by their FLOPs) for a block of
        ``parameters`` = 12 h^2."""
        if self.processors == 0:
            return 1.0
        hidden = max(1, round(math.sqrt(parameters / 12)))
        products = ((3 * hidden, 3), (hidden, 1), (4 * hidden, 4), (hidden, 4))
        weighted = 0.0
        for outputs, weight in products:
            tiles = math.ceil(tokens / self.tile_m) * math.ceil(outputs / self.tile_n)
            weighted += weight * tiles / (math.ceil(tiles / self.processors) * self.processors)
        return weighted / sum(weight for _, weight in products)

    @classmethod
    def load(cls, name: str) -> Hardware:
        """A description by name (a file of ``zeropp/simulate/hardware/``) or by path."""
        path = Path(name) if name.endswith(".json") else HARDWARE_FOLDER / f"{name}.json"
        if not path.exists():
            raise ValueError(f"hardware {name!r}: no such description; allowed values: {available()} or a .json path")
        values = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}; allowed fields: {sorted(known)}")
        return cls(**values)


def available() -> list[str]:
    return sorted(path.stem for path in HARDWARE_FOLDER.glob("*.json"))
