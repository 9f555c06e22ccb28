"""Command line: ``zeropp demo`` and ``zeropp train``.

    zeropp demo                                  # 4 CPU ranks as 2 nodes x 2, built-in defaults
    zeropp train --model medium --steps 500 --precision bf16 --world-size 4 --ranks-per-node 2
    torchrun --nproc-per-node 4 -m zeropp_tools.cli.main train ...   # join a torchrun world instead
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from zeropp.accounting import format_table
from zeropp.config import DTYPES, ZeroConfig
from zeropp.deepspeed_config import load_deepspeed_config
from zeropp.topology import Layout
from zeropp.launch import finish_distributed, init_from_torchrun, spawn_ranks
from zeropp.train import TrainConfig, train
from zeropp.train.loop import write_summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeropp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="train the example GPT on 4 CPU ranks (2 nodes x 2) with defaults")
    trainer = commands.add_parser("train", help="train the example GPT with options")
    trainer.add_argument("--model", default="small", help="GPT size: tiny, small, medium")
    trainer.add_argument("--steps", type=int, default=300)
    trainer.add_argument("--batch-per-rank", type=int, default=8)
    trainer.add_argument("--seq-len", type=int, default=128)
    trainer.add_argument("--accumulation", type=int, default=1)
    trainer.add_argument("--lr", type=float, default=3e-3)
    trainer.add_argument("--precision", default="fp32", help=f"compute dtype: {', '.join(DTYPES)}")
    trainer.add_argument("--reduce-dtype", default=None, help="gradient communication dtype (default: compute dtype)")
    trainer.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    trainer.add_argument("--qwz", action="store_true", help="quantized weight all-gather (INT8 by default)")
    trainer.add_argument("--hpz", type=int, default=1, help="hpZ group size (1 = off; must divide ranks per node)")
    trainer.add_argument("--qgz", action="store_true", help="quantized two-hop gradient reduce-scatter")
    trainer.add_argument("--weight-bits", type=int, default=8, help="qwZ bits per weight: 4, 8 or 12")
    trainer.add_argument("--late-bits-from-step", type=int, default=0,
                         help="from this step on use --late-weight-bits and --late-gradient-bits (0: never)")
    trainer.add_argument("--late-weight-bits", type=int, default=12)
    trainer.add_argument("--late-gradient-bits", type=int, default=4, help="qgZ inter-node bits from the late step on")
    trainer.add_argument("--hierarchical-gather", action="store_true",
                         help="gather weights in two hops: this node's shards exact, only other nodes' across")
    trainer.add_argument("--gradient-bits", default="4,4", help="qgZ bits intra-node,inter-node")
    trainer.add_argument("--gradient-grid", default="uniform",
                         help="qgZ inter-node levels: uniform, or log (4 bits on powers of two)")
    trainer.add_argument("--block-size", type=int, default=256, help="values per quantization block")
    trainer.add_argument("--gradient-chunks", type=int, default=2, help="qgZ pipeline chunks per unit")
    trainer.add_argument("--compile-quantization", action="store_true", help="quantize with torch.compile")
    trainer.add_argument("--deepspeed-config", default=None, help="DeepSpeed-style JSON (zero_optimization, bf16, ...)")
    trainer.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here")
    trainer.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    trainer.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    trainer.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")
    trainer.add_argument("--world-size", type=int, default=4, help="ranks to start (ignored under torchrun)")
    trainer.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE, or 2 when spawning")
    trainer.add_argument("--seed", type=int, default=0)
    trainer.add_argument("--out", default="runs/train", help="folder for metrics.jsonl and summary.json")
    export = commands.add_parser("export", help="write one consolidated safetensors file from a sharded checkpoint")
    export.add_argument("checkpoint", help="a checkpoint folder, or a root whose 'latest' names one")
    export.add_argument("output", help="path of the .safetensors file to write")
    cluster = commands.add_parser("cluster", help="run a zeropp command over emulated nodes with a shaped link")
    cluster.add_argument("--nodes", type=int, default=2)
    cluster.add_argument("--ranks-per-node", type=int, default=2)
    cluster.add_argument("--bandwidth", type=float, default=None, help="Mbit/s of each node's link (default: unshaped)")
    cluster.add_argument("--latency", type=float, default=0.0, help="one-way latency added per node link, ms")
    cluster.add_argument("--timeout", type=float, default=3600.0)
    cluster.add_argument("arguments", nargs=argparse.REMAINDER, help="the zeropp command to run, after --")
    plan = commands.add_parser("plan", help="predict step time per ZeRO++ variant and recommend one")
    plan.add_argument("--model", default="small")
    plan.add_argument("--tokens-per-rank", type=int, default=256)
    plan.add_argument("--nodes", type=int, default=2)
    plan.add_argument("--ranks-per-node", type=int, default=2)
    plan.add_argument("--inter-node-mbit", type=float, default=200.0)
    plan.add_argument("--rank-gflops", type=float, default=5.0, help="FLOP/s one rank achieves on the model, in G")
    plan.add_argument("--paper", action="store_true", help="predict the ZeRO++ paper's settings instead")
    plan.add_argument("--compare", metavar="THROUGHPUT_JSON",
                      help="compare predictions with a `zeropp bench throughput` result file")
    study = commands.add_parser("study", help="long studies").add_subparsers(dest="study", required=True)
    convergence = study.add_parser("convergence", help="loss under ZeRO-3 and compressed variants, 2 nodes x 2")
    convergence.add_argument("--model", default="small")
    convergence.add_argument("--steps", type=int, default=1500)
    convergence.add_argument("--batch-per-rank", type=int, default=8)
    convergence.add_argument("--seq-len", type=int, default=128)
    convergence.add_argument("--lr", type=float, default=2e-3)
    convergence.add_argument("--eval-every", type=int, default=100)
    convergence.add_argument("--eval-batches", type=int, default=16)
    convergence.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each runs ZeRO-3 and the main variants")
    convergence.add_argument("--out", default="runs/convergence")
    convergence.add_argument("--report-only", action="store_true", help="rebuild table and plot from finished runs")
    bench = commands.add_parser("bench", help="benchmarks and reports").add_subparsers(dest="bench", required=True)
    comm = bench.add_parser("comm", help="bytes per step of ZeRO-3 and ZeRO++ variants, measured and predicted")
    comm.add_argument("--model", default="small", help="GPT size: tiny, small, medium")
    comm.add_argument("--layouts", default="2x2,2x4,4x2", help="comma-separated NODESxRANKS layouts")
    comm.add_argument("--out", default="runs/bench/comm.json")
    grad_error = bench.add_parser("grad-error", help="qgZ schemes' error on real GPT gradients vs the exact mean")
    grad_error.add_argument("--steps", type=int, default=32)
    grad_error.add_argument("--out", default="runs/bench/gradient_error.json")
    throughput = bench.add_parser("throughput", help="tokens/s per variant and bandwidth on an emulated cluster")
    throughput.add_argument("--nodes", type=int, default=2)
    throughput.add_argument("--ranks-per-node", type=int, default=2)
    throughput.add_argument("--bandwidths", default="none,1000,200,50", help="Mbit/s per node link; none = unshaped")
    throughput.add_argument("--variants", default="zero3,qwz,hpz,qgz,zero++,fsdp2,fsdp2-reshard-node,fsdp2-hsdp,"
                            "deepspeed-zero3,deepspeed-zero++", help="DeepSpeed ones need `make deepspeed-setup`")
    throughput.add_argument("--model", default="medium")
    throughput.add_argument("--steps", type=int, default=10)
    throughput.add_argument("--batch-per-rank", type=int, default=4)
    throughput.add_argument("--seq-len", type=int, default=64)
    throughput.add_argument("--precision", default="bf16")
    throughput.add_argument("--out", default="runs/bench/throughput")
    quant = bench.add_parser("quant", help="block quantization speed vs copy and error vs per-tensor scales")
    quant.add_argument("--numel", type=int, default=1 << 22)
    quant.add_argument("--out", default="runs/bench/quant.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            args = build_parser().parse_args(["train", "--out", "runs/demo"])
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "export":
            return _run_export(args)
        if args.command == "cluster":
            return _run_cluster(args)
        if args.command == "plan":
            from zeropp_tools import plan as planner

            return planner.main(args)
        if args.command == "study":
            from zeropp_tools.study import convergence

            return convergence.main(args)
        return run_training(args)
    except ValueError as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("zeropp: interrupted; everything started was stopped and removed", file=sys.stderr)
        return 130


def _run_cluster(args) -> int:
    from zeropp_tools.cluster import ClusterSpec
    from zeropp_tools.cluster.launch import run_on_cluster

    arguments = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    if not arguments:
        raise ValueError("give the zeropp command to run after --, for example: zeropp cluster -- train --steps 20")
    spec = ClusterSpec(args.nodes, args.ranks_per_node, args.bandwidth, args.latency)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed job still removes its namespaces
    try:
        result = run_on_cluster(spec, arguments, args.timeout)
    except RuntimeError as error:
        print(f"zeropp: error: {error}", file=sys.stderr)
        return 2
    print(result["output"])
    for node, counters in enumerate(result["link_bytes"]):
        print(f"node {node} link: sent {counters['tx_bytes'] / 1e6:.3f} MB, received {counters['rx_bytes'] / 1e6:.3f} MB, "
              f"TCP segments resent {counters['tcp_retransmitted_segments']}")
    print(f"exit codes {result['exit_codes']}; logs in {result['logs']}")
    return 0 if all(code == 0 for code in result["exit_codes"]) else 1


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_export(args) -> int:
    report = measure_export(args.checkpoint, args.output)
    print(
        f"wrote {report['output']}: {report['model_bytes'] / 1e6:.1f} MB of fp32 parameters; "
        f"peak memory +{report['peak_rss_increase_bytes'] / 1e6:.1f} MB "
        f"({report['peak_rss_increase_bytes'] / report['model_bytes']:.2f}x the model)"
    )
    return 0


def measure_export(checkpoint, output) -> dict:
    from zeropp.checkpoint import export_consolidated, resolve_checkpoint
    from zeropp.checkpoint.export import model_bytes
    from zeropp.checkpoint.format import read_metadata
    from zeropp.memory import peak_rss_increase

    size = model_bytes(read_metadata(resolve_checkpoint(checkpoint)))
    written, peak = peak_rss_increase(lambda: export_consolidated(checkpoint, output))
    return {"output": str(written), "model_bytes": size, "peak_rss_increase_bytes": peak}


def _run_bench(args) -> int:
    if args.bench == "comm":
        from zeropp_tools.bench import comm

        return comm.main(args)
    if args.bench == "throughput":
        from zeropp_tools.bench import throughput

        return throughput.main(args)
    if args.bench == "grad-error":
        from zeropp_tools.bench import gradient_error

        return gradient_error.main(args)
    from zeropp_tools.bench import quantization

    return quantization.main(args)


def run_training(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    under_torchrun = "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ
    ranks_per_node = args.ranks_per_node
    if ranks_per_node is None and not under_torchrun:
        ranks_per_node = 2 if args.world_size % 2 == 0 else 1
    zero, training = _zero_config(args)
    config = TrainConfig(
        model_size=args.model, steps=args.steps, seq_len=args.seq_len, learning_rate=args.lr, seed=args.seed,
        batch_per_rank=training.get("train_micro_batch_size_per_gpu", args.batch_per_rank),
        accumulation=training.get("gradient_accumulation_steps", args.accumulation),
        clip=training.get("gradient_clipping", 1.0),
        ranks_per_node=ranks_per_node, metrics_path=str(out / "metrics.jsonl"), zero=zero,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        collective_timeout_s=args.timeout,
    )
    if under_torchrun:
        rank, world_size = init_from_torchrun(args.timeout)
        summary = train(rank, world_size, config)
        finish_distributed()  # a rank that exits while peers still read makes gloo abort them
        if rank != 0:
            return 0
    else:
        config.zero.check_layout(Layout(args.world_size, ranks_per_node).ranks_per_node)
        summary = spawn_ranks(train, args.world_size, (config,), timeout_s=24 * 3600, collective_timeout_s=args.timeout)[0]
    write_summary(summary, out / "summary.json")
    print(_report(summary, out))
    return 0


def _zero_config(args) -> tuple[ZeroConfig, dict]:
    if args.deepspeed_config:
        return load_deepspeed_config(args.deepspeed_config)
    try:
        intra, inter = (int(bits) for bits in args.gradient_bits.split(","))
    except ValueError:
        raise ValueError(f"--gradient-bits={args.gradient_bits!r} must look like 4,4 (intra,inter)") from None
    zero = ZeroConfig(
        compute_dtype=args.precision, reduce_dtype=args.reduce_dtype, activation_checkpointing=args.checkpointing,
        quantized_weights=args.qwz, weight_bits=args.weight_bits, hpz_size=args.hpz, quantized_gradients=args.qgz,
        gradient_bits_intra_node=intra, gradient_bits_inter_node=inter, gradient_grid_inter_node=args.gradient_grid,
        quantization_block_size=args.block_size,
        gradient_chunks=args.gradient_chunks, compile_quantization=args.compile_quantization,
        hierarchical_weight_gather=args.hierarchical_gather, late_bits_from_step=args.late_bits_from_step,
        late_weight_bits=args.late_weight_bits, late_gradient_bits_inter_node=args.late_gradient_bits,
    )
    return zero, {}


def _report(summary: dict, out: Path) -> str:
    config = summary["config"]
    lines = [
        f"model: GPT {config['model_size']}, {config['num_parameters']:,} parameters; "
        f"world: {config['world_size']} ranks = {config['num_nodes']} nodes x {config['ranks_per_node']}; "
        f"precision: {config['zero']['compute_dtype']}; qwZ {config['zero']['quantized_weights']}, "
        f"hpZ size {config['zero']['hpz_size']}, qgZ {config['zero']['quantized_gradients']}",
        f"train loss {summary['final_train_loss']:.4f}   validation loss {summary['validation_loss']:.4f}   "
        f"{summary['tokens_per_s']:,.0f} tokens/s (median step)",
        "",
        "communication per step, this rank (rank 0):",
        format_table(summary["comm_per_step"]),
        "",
        f"metrics: {out / 'metrics.jsonl'}   summary: {out / 'summary.json'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
