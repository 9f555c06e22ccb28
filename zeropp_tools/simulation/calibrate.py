"""Measure the emulated cluster as the simulator describes hardware: ``zeropp simulate-calibrate``.

Run under torchrun on every node of the emulated cluster (the command starts it). Every
rank measures at the same time, so each sees the machine as a training job shares it:

    sustained_flops         forward + backward of the GPT, not sharded, at the benchmark's
                            batch and precision: 6 x parameters x tokens / seconds
    slowdown                the same, while a loop of world all-gathers runs beside it
    intra-node bandwidth    all-gather of 8 MB per rank inside the node
    step latencies          one-byte all-gathers inside the node and across nodes
    arrival skew            } each rank runs one unit's forward, then waits on a world
    adapter                 } all-gather (1 byte; 1 MB per rank, or on a shaped link
                            } enough to cross in 0.1 s), round after round; median of 3
    adapter, parallel flows the same with each rank gathering among its peers on the other
                            nodes (every rank of a node a flow across the link at once)
    host receive rates      the unshaped links' rates: loopback links are the cores' copies
    kernels                 INT8 block quantize + dequantize (3 bytes moved per code byte)
    optimizer               AdamW over this rank's share of the parameters

The arrival skew and the adapter are measured the way a training step uses the link, in
one thread: compute, then a collective that waits for every rank's compute. On four ranks
sharing two cores a rank that reaches a collective first waits for the others' compute and
for the scheduler: 8-10 ms per collective beyond the idle gather's time on an AMD EPYC of
2 cores, where idle one-byte probes read 0.5-1 ms per ring step. The skew is what the
loaded one-byte gather takes beyond the idle ring steps, which hold the whole idle latency
(the base latency is 0). On unshaped veth pairs no wire limits a transfer: the cores that
compute copy every byte, so the unshaped rates are also what a received byte costs them.
With ``--link-only`` (on a shaped cluster) only the adapter is measured: what the shaped
link carries in that pattern, with chunks sized to cross in 0.1 s at the shaper's rate
(``--shaped-mbit``). Rank 0 writes the hardware description, each number with how it was
measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp import traffic
from zeropp.launch import exit_without_finalization, finish_distributed, init_from_torchrun
from zeropp.models import GPT, GPTConfig
from zeropp.quantization.blocks import BlockFormat, dequantize, quantize
from zeropp.topology import Layout, Topology
from zeropp_tools.cluster import payload_bytes_per_s

REPEATS = 5
# An idle probe's rate (intra-node gathers, 1-byte latencies) is its fastest (noise on shared
# cores only slows one), as auto mode's probe keeps the fastest of three: single 8 MB probes
# inside a node read 65 MB/s in one calibration and 234-249 MB/s in the next two, minutes
# apart on an idle machine.
PROBES = 3
# Alone/beside pairs of the slowdown probe. Its median over 3 pairs read 7%, 18% and 37% in
# three calibrations of one afternoon with the same code. A pair is 12 steps of the GPT.
SLOWDOWN_PAIRS = 9
# Loaded probes (compute, then a gather) per link rate, whose median it keeps: two flows
# through one shaper share it differently from probe to probe (a flow per rank at 200 Mbit/s
# read 177, 204 and 219 Mbit/s in three probes of one hour).
LOADED_PROBES = 3
LOADED_ROUNDS = 16  # compute-then-gather rounds of the loaded probes; each rank keeps its median
LINK_CHUNK = 1 << 20  # bytes per rank: about one unit's gather share of the benchmark's GPT
# A shaped link's probe moves at least this long at the shaper's rate. Ranks that reach a
# gather first send while the last is still computing (the arrival skew, about 6 ms), which
# a short transfer hides: 1 MB chunks read 1.44 Gbit/s of payload through a 1 Gbit/s shaper.
PROBE_TRANSFER_S = 0.1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_seconds(work) -> float:
    work()  # warm-up: allocation and caches
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _slowest(seconds: float, group=None) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value.item()


def _gather_seconds(group, numel: int, size: int) -> float:
    """The fastest of ``PROBES`` probes, each the slowest rank's median all-gather."""
    shard = torch.zeros(numel, dtype=torch.uint8)
    output = torch.empty(numel * size, dtype=torch.uint8)
    probes = []
    for _ in range(PROBES):
        dist.barrier()
        probes.append(_slowest(_median_seconds(lambda: dist.all_gather_into_tensor(output, shard, group=group))))
    return min(probes)


def ring_bytes_into_node(layout: Layout, chunk_bytes: int, group_of=None) -> int:
    """Bytes ring all-gathers of ``chunk_bytes`` per rank carry into node 0, as the
    accounting counts them, each rank of node 0 in its group ``group_of(rank)`` (default:
    the world). On 2 x 2 the world ring enters each node once per step, so 3 chunks, not
    the 4 remote ones (one of them crosses twice, once each way)."""
    group_of = group_of or (lambda rank: range(layout.world_size))
    return sum(traffic.ring(layout, rank, group_of(rank), chunk_bytes).inter_node
               for rank in range(layout.world_size) if layout.node_of(rank) == 0)


def _alone_and_beside(step, world, side_numel: int, gather_s: float, world_size: int) -> tuple[float, float]:
    """The slowest rank's median step alone, then beside a loop of world all-gathers."""
    dist.barrier()
    alone = _slowest(_median_seconds(step))
    # A count every rank agrees on (a loop stopped by a flag would leave a peer waiting),
    # enough to cover the warm-up and the timed steps.
    count = int(1.5 * (REPEATS + 1) * alone / gather_s) + 1

    def gathers() -> None:
        shard = torch.zeros(side_numel, dtype=torch.uint8)
        output = torch.empty(side_numel * world_size, dtype=torch.uint8)
        for _ in range(count):
            dist.all_gather_into_tensor(output, shard, group=world)

    side = threading.Thread(target=gathers)
    dist.barrier()
    side.start()
    beside = _median_seconds(step)
    side.join()
    return alone, _slowest(beside)


def _mean_over_ranks(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _wait_after_compute(segment, group, numel: int, size: int) -> float:
    """Seconds a rank waits in an all-gather of ``numel`` bytes per rank issued right after
    ``segment``, round after round: each rank's median, averaged over the ranks (the first
    to arrive waits for the others' compute, the last only for the transfer)."""
    shard = torch.zeros(numel, dtype=torch.uint8)
    output = torch.empty(numel * size, dtype=torch.uint8)
    segment()
    dist.all_gather_into_tensor(output, shard, group=group)  # warm-up: connections and buffers
    waits = []
    for _ in range(LOADED_ROUNDS):
        segment()
        started = time.perf_counter()
        dist.all_gather_into_tensor(output, shard, group=group)
        waits.append(time.perf_counter() - started)
    return _mean_over_ranks(statistics.median(waits))


def probe_chunk_bytes(chunks_into_node: int, shaped_bytes_per_s: float = 0.0) -> int:
    """Bytes per rank of a link probe whose gather moves ``chunks_into_node`` chunks into a
    node (0 on one node): ``LINK_CHUNK``, or on a link shaped to ``shaped_bytes_per_s`` of
    payload enough to cross in ``PROBE_TRANSFER_S``."""
    if not (shaped_bytes_per_s and chunks_into_node):
        return LINK_CHUNK
    return max(LINK_CHUNK, math.ceil(shaped_bytes_per_s * PROBE_TRANSFER_S / chunks_into_node))


def _loaded_rate(segment, group, size: int, chunks_into_node: int, shaped_bytes_per_s: float) -> tuple[float, float]:
    """(seconds a one-byte all-gather on ``group`` waits after compute, payload bytes per
    second into a node of a gather of ``probe_chunk_bytes`` per rank beyond that wait), the
    medians of ``LOADED_PROBES`` probes."""
    numel = probe_chunk_bytes(chunks_into_node, shaped_bytes_per_s)
    empties, rates = [], []
    for _ in range(LOADED_PROBES):
        dist.barrier()
        empty = _wait_after_compute(segment, group, 1, size)
        chunk = _wait_after_compute(segment, group, numel, size)
        empties.append(empty)
        # A one-byte round that ran slow cannot leave the transfer under half the chunk's wait.
        rates.append(chunks_into_node * numel / max(chunk - empty, chunk / 2))
    return statistics.median(empties), statistics.median(rates)


def _loaded_link(segment, topology: Topology, shaped_bytes_per_s: float = 0.0) -> tuple[float, float, float]:
    """(seconds a one-byte world all-gather waits after compute, the adapter's payload
    rate in a world gather (one flow across the link each way), and in gathers among each
    rank's peers on the other nodes (a flow per rank of the node))."""
    layout = topology.layout
    empty, adapter = _loaded_rate(segment, topology.group("world").handle, topology.world_size,
                                  ring_bytes_into_node(layout, 1), shaped_bytes_per_s)
    peers = topology.group("inter_node")
    _, parallel = _loaded_rate(segment, peers.handle, peers.size, ring_bytes_into_node(
        layout, 1, lambda rank: layout.inter_node_ranks(layout.local_index_of(rank))), shaped_bytes_per_s)
    return empty, adapter, parallel


def _unit_forward(model: GPT, tokens: tuple[int, int]):
    """One block's forward at the benchmark's batch: what runs between two forward gathers."""
    batch, length = tokens
    hidden = torch.randn(batch, length, model.config.embed_dim, dtype=next(model.parameters()).dtype)
    block = model.blocks[0]
    return lambda: block(hidden)


def _model(model_size: str, precision: str) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(model_size)).to(DTYPES[precision])


def measure_link(model_size: str, tokens: tuple[int, int], precision: str, topology: Topology, mbit: float) -> dict:
    """The adapter alone, the loaded way, on a link shaped to ``mbit``."""
    _, adapter, parallel = _loaded_link(_unit_forward(_model(model_size, precision), tokens), topology,
                                        payload_bytes_per_s(mbit))
    return {"adapter_bytes_per_s": adapter, "parallel_flows_adapter_bytes_per_s": parallel}


def _compute(model: GPT, tokens: tuple[int, int], topology: Topology) -> dict:
    """The GPT's forward + backward on every rank at once, alone and beside world all-gathers."""
    batch, length = tokens
    inputs = torch.randint(0, model.config.vocab_size, (batch, length + 1))

    def step() -> None:
        model(inputs[:, :-1], inputs[:, 1:]).float().backward()

    world = topology.group("world").handle
    side_numel = 4 << 20
    gather_s = _gather_seconds(world, side_numel, topology.world_size)
    pairs = [_alone_and_beside(step, world, side_numel, gather_s, topology.world_size) for _ in range(SLOWDOWN_PAIRS)]
    alone = statistics.median(alone for alone, _ in pairs)
    return {"sustained_flops": 6 * model.num_parameters() * batch * length / alone,
            "slowdown_during_communication": statistics.median(max(0.0, 1 - alone / beside) for alone, beside in pairs)}


def _links(model: GPT, tokens: tuple[int, int], topology: Topology) -> dict:
    """The intra-node rate and the ring steps' latencies on idle links, then the arrival
    skew and the adapter after compute."""
    dist.barrier()
    per_node, nodes = topology.ranks_per_node, topology.num_nodes
    intra_node = topology.group("intra_node").handle
    intra_numel = 8 << 20
    intra_s = _gather_seconds(intra_node, intra_numel, per_node)
    intra_latency = _gather_seconds(intra_node, 1, per_node) / max(1, per_node - 1)
    world_latency = _gather_seconds(topology.group("world").handle, 1, topology.world_size)
    inter_latency = max(0.0, world_latency - (topology.world_size - nodes) * intra_latency) / max(1, nodes - 1)
    loaded_latency, adapter, parallel = _loaded_link(_unit_forward(model, tokens), topology)
    intra_node_bytes_per_s = (per_node - 1) * intra_numel / intra_s
    return {"intra_node_bytes_per_s": intra_node_bytes_per_s,
            "base_latency_s": 0.0,
            "intra_node_step_latency_s": intra_latency,
            "inter_node_step_latency_s": inter_latency,
            "arrival_skew_s": max(0.0, loaded_latency - world_latency),
            "host_receive_intra_node_bytes_per_s": intra_node_bytes_per_s,
            "host_receive_inter_node_bytes_per_s": adapter,
            "adapter_bytes_per_s": adapter,
            "parallel_flows_adapter_bytes_per_s": parallel}


def _kernels(parameters: int, topology: Topology) -> dict:
    """INT8 quantize + dequantize, and AdamW over this rank's share, as bytes per second."""
    values = torch.randn(1 << 22)
    fmt = BlockFormat(8, 2048)
    packed = quantize(values, fmt)
    kernel_s = _median_seconds(lambda: quantize(values, fmt)) + _median_seconds(
        lambda: dequantize(packed, fmt, values.numel()))
    kernel_bytes_per_s = _slowest(2 * 3 * values.numel() / kernel_s)
    share = [torch.nn.Parameter(torch.zeros(parameters // topology.world_size))]
    share[0].grad = torch.zeros_like(share[0])
    optimizer = torch.optim.AdamW(share, lr=1e-4)
    optimizer_s = _slowest(_median_seconds(optimizer.step))
    return {"kernel_bytes_per_s": kernel_bytes_per_s,
            "optimizer_bytes_per_parameter": max(1, round(optimizer_s * kernel_bytes_per_s / share[0].numel()))}


def measure(model_size: str, tokens: tuple[int, int], precision: str, topology: Topology) -> dict:
    """Every number of the hardware description but the constants ``describe`` adds."""
    model = _model(model_size, precision)
    return {**_compute(model, tokens, topology), **_links(model, tokens, topology),
            **_kernels(model.num_parameters(), topology)}


def link_source(shaped: bool = False) -> str:
    chunk = (f"chunks of at least {LINK_CHUNK / 2**20:g} MB per rank, sized to cross in {PROBE_TRANSFER_S:g} s at the "
             "shaper's payload rate" if shaped else f"{LINK_CHUNK / 2**20:g} MB per rank")
    return (f"the ring's payload bytes into a node of a world all-gather of {chunk}, right after one unit's forward, "
            f"over its wait beyond a 1-byte one's (each rank's median of {LOADED_ROUNDS} rounds, the mean over "
            f"ranks; the median of {LOADED_PROBES} such probes)")


def describe(measured: dict, arguments: argparse.Namespace, topology: Topology, source: dict) -> dict:
    where = (f"measured by zeropp simulate-calibrate at {source['git_commit']} on {source['machine']['cpu_model']}, "
             f"{topology.num_nodes} x {topology.ranks_per_node} ranks of the emulated cluster at once, "
             f"GPT {arguments.model} at {arguments.batch_per_rank} x {arguments.seq_len} tokens, {arguments.precision}")
    return {
        "name": f"emulated cluster: {topology.num_nodes} x {topology.ranks_per_node} CPU ranks ({source['machine']['cpu_model']})",
        **measured,
        "processors": 0, "tile_m": 1, "tile_n": 1,
        "network_adapters_per_node": 1,
        "link_efficiency": 1.0,
        "sources": {
            "sustained_flops": f"6 x parameters x tokens / forward + backward seconds (the median over the slowdown's "
                               f"{SLOWDOWN_PAIRS} pairs of each one's median of {REPEATS} steps alone), {where}",
            "slowdown_during_communication": f"1 - that step's time / its time beside a loop of 4 MB world all-gathers, median of {SLOWDOWN_PAIRS} pairs, {where}",
            "intra_node_bytes_per_s": f"an 8 MB-per-rank all-gather inside the node, fastest of {PROBES}, {where}",
            "base_latency_s": "0: the ring steps hold the whole latency of an idle 1-byte gather",
            "intra_node_step_latency_s": f"a 1-byte all-gather inside the node over its G - 1 steps, {where}",
            "inter_node_step_latency_s": f"a 1-byte world all-gather less its intra-node steps, {where}",
            "arrival_skew_s": f"what a 1-byte world all-gather right after one unit's forward waits (each rank's median of "
                              f"{LOADED_ROUNDS} rounds, the mean over ranks; the median of {LOADED_PROBES} such probes) "
                              f"beyond the idle ring steps, {where}",
            "host_receive_intra_node_bytes_per_s": "the intra-node rate: the cores copy every byte of a veth link",
            "host_receive_inter_node_bytes_per_s": "the unshaped adapter rate: the cores copy every byte of a veth "
                                                   "link; a shaped link's own rate is the wire's, not the cores'",
            "adapter_bytes_per_s": f"{link_source()} on the unshaped link, {where}; a shaped run replaces it with the same "
                                   "probe on the shaped link, its chunks sized to the shaper's rate",
            "link_efficiency": "1: the adapter is measured as payload bytes",
            "parallel_flows_adapter_bytes_per_s": f"the same probe with each rank gathering among its peers on the other "
                                                  f"nodes, {where}; a shaped run probes it there too",
            "kernel_bytes_per_s": f"INT8 block quantize + dequantize of 4M values, 3 bytes per code byte, {where}",
            "optimizer_bytes_per_parameter": f"AdamW over 1/W of the parameters, as bytes at the kernel rate, {where}",
            "processors": "a CPU core has no waves to fill",
            "tile_m": "unused without waves",
            "tile_n": "unused without waves",
            "network_adapters_per_node": "one veth pair per emulated node",
        },
    }


def main() -> int:
    from zeropp_tools.bench.provenance import provenance

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--link-only", action="store_true",
                        help="measure the adapter alone (on a shaped cluster): writes {adapter_bytes_per_s, source}")
    parser.add_argument("--shaped-mbit", type=float, help="with --link-only: the shaper's rate, which sizes the probe")
    arguments = parser.parse_args()
    if arguments.link_only != (arguments.shaped_mbit is not None):
        parser.error("--link-only and --shaped-mbit go together: the shaped link's probe is sized to the shaper's rate")
    torch.set_num_threads(1)
    init_from_torchrun()
    topology = Topology.from_environment()
    source = provenance()
    tokens = (arguments.batch_per_rank, arguments.seq_len)
    if arguments.link_only:
        description = {**measure_link(arguments.model, tokens, arguments.precision, topology, arguments.shaped_mbit),
                       "source": f"{link_source(shaped=True)}, at {source['git_commit']}"}
    else:
        description = describe(measure(arguments.model, tokens, arguments.precision, topology), arguments, topology,
                               source)
    if topology.rank == 0:
        Path(arguments.out).write_text(json.dumps(description, indent=2) + "\n")
    finish_distributed()
    exit_without_finalization(0)


if __name__ == "__main__":
    raise SystemExit(main())
