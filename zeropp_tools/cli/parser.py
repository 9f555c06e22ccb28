"""The ``zeropp`` argument parser: every subcommand, flag, choice and default."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

from .logs import LOG_LEVELS
from .train_flags import add_train_arguments
from .values import MODEL_SIZES, PRECISIONS, positive_float, positive_int
from ..rlhf.flags import add_rlhf_arguments

OVERVIEW = """\
ZeRO-3 and ZeRO++ sharded data parallel training, benchmarks and studies.

examples:
  zeropp demo                   # ZeRO-3 vs ZeRO++ on 4 CPU ranks as 2 nodes x 2, about two minutes
  zeropp train --model medium --steps 500 --precision bf16 --world-size 4 --ranks-per-node 2
  zeropp train --qwz --hpz 2 --qgz --out runs/zeropp
  torchrun --nproc-per-node 4 -m zeropp_tools.cli.main train ...   # join a torchrun world instead
  zeropp COMMAND --help         # every flag of a command, with its default
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the hand-wrapped examples of descriptions and appends each flag's default.
    No default is shown for on/off flags (always off) or for None, whose meaning the help
    text itself spells out ("default: the compute dtype")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


def package_version() -> str:
    try:
        return version("zeropp")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeropp", description=OVERVIEW, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the installed zeropp version and exit")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="least severe log messages to show (DEBUG adds detail, WARNING keeps only problems)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(commands)
    add_train_arguments(_subcommand(
        commands, "train", "train the example GPT with options",
        "Train the built-in GPT on the built-in corpus with ZeRO-3 and any ZeRO++ optimization.",
    ))
    _add_export(commands)
    _add_cluster(commands)
    _add_plan(commands)
    _add_study(commands)
    _add_bench(commands)
    _add_results(commands)
    _add_dryrun(commands)
    add_rlhf_arguments(_subcommand(
        commands, "rlhf", "RLHF: SFT, a reward model, PPO over four sharded models",
        "Supervised fine-tuning of the GPT on the corpus, a reward model trained on preference pairs\n"
        "(real continuation over shuffled), then PPO with actor and critic trained and the reference and\n"
        "reward models frozen, all sharded on 4 CPU ranks as 2 nodes x 2. Metrics and a plot in --out.",
    ))
    return parser


def _subcommand(commands, name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=help_text, description=description or help_text,
                               formatter_class=HelpFormatter)


def _add_demo(commands) -> None:
    demo = _subcommand(
        commands, "demo", "train ZeRO-3 and ZeRO++ side by side on 4 CPU ranks (2 nodes x 2) and compare them",
        "Train the built-in GPT on the built-in corpus twice, as ZeRO-3 and as ZeRO++ (qwZ INT8 weights,\n"
        "hpZ over each 2-rank node, qgZ INT4 gradients), with the same seed and data on 4 CPU ranks acting\n"
        "as 2 nodes x 2. Reports losses, cross-node bytes per step and tokens/s, and plots both.",
    )
    demo.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size of both runs")
    demo.add_argument("--steps", type=positive_int, default=150, help="training steps of each run")
    demo.add_argument("--batch-per-rank", type=positive_int, default=8, help="sequences per rank per step")
    demo.add_argument("--seq-len", type=positive_int, default=128,
                      help="tokens per sequence (at most the model's block size)")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and data, shared by both runs")
    demo.add_argument("--out", default="runs/demo", help="folder for the plot and one subfolder of metrics per run")


def _add_export(commands) -> None:
    export = _subcommand(commands, "export", "write one consolidated safetensors file from a sharded checkpoint")
    export.add_argument("checkpoint", help="a checkpoint folder, or a root whose 'latest' names one")
    export.add_argument("output", help="path of the .safetensors file to write")


def _add_cluster(commands) -> None:
    cluster = _subcommand(
        commands, "cluster", "run a zeropp command over emulated nodes with a shaped link",
        "Run a zeropp command under torchrun on emulated nodes (network namespaces, needs root), e.g.\n"
        "  zeropp cluster --nodes 2 --bandwidth 200 -- train --steps 20",
    )
    cluster.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes")
    cluster.add_argument("--ranks-per-node", type=positive_int, default=2, help="torchrun processes per node")
    cluster.add_argument("--bandwidth", type=positive_float, default=None,
                         help="Mbit/s of each node's link (default: unshaped)")
    cluster.add_argument("--latency", type=float, default=0.0, help="one-way latency added per node link, ms")
    cluster.add_argument("--timeout", type=positive_float, default=3600.0,
                         help="seconds before the whole run is killed")
    cluster.add_argument("arguments", nargs=argparse.REMAINDER, help="the zeropp command to run, after --")


def _add_plan(commands) -> None:
    plan = _subcommand(commands, "plan", "predict step time per ZeRO++ variant and recommend one")
    plan.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size")
    plan.add_argument("--layers", type=positive_int, default=None, help="transformer blocks (replaces --model's)")
    plan.add_argument("--hidden", type=positive_int, default=None, help="hidden size, a multiple of 128 for more "
                                                                        "than one head (replaces --model's)")
    plan.add_argument("--vocabulary", type=positive_int, default=None, help="vocabulary size (replaces --model's)")
    plan.add_argument("--hf-config", default=None, metavar="CONFIG_JSON",
                      help="a Hugging Face config.json (or its folder): its layers, hidden size and vocabulary")
    plan.add_argument("--tokens-per-rank", type=positive_int, default=256,
                      help="tokens each rank processes per micro-step")
    plan.add_argument("--accumulation", type=positive_int, default=1,
                      help="micro-steps per optimizer step; those before the last under no_sync (node accumulation)")
    plan.add_argument("--keep-weights-between-micro-steps", action="store_true",
                      help="with --accumulation: every unit stays gathered between micro-steps (full weights per rank)")
    plan.add_argument("--nodes", type=positive_int, default=2, help="nodes")
    plan.add_argument("--ranks-per-node", type=positive_int, default=2, help="ranks per node")
    plan.add_argument("--hardware", default=None, metavar="NAME_OR_JSON",
                      help="a hardware description (v100-dgx2, a100-8gpu, h100-8gpu, or a .json file such as the "
                           "throughput benchmark's cluster-calibration.json); default: the one --rank-gflops and "
                           "--inter-node-mbit give")
    plan.add_argument("--inter-node-mbit", type=positive_float, default=None,
                      help="Mbit/s of each node's link (default 200; replaces the description's adapters)")
    plan.add_argument("--rank-gflops", type=positive_float, default=None,
                      help="FLOP/s one rank sustains on the model, in G (default 5; replaces the description's)")
    plan.add_argument("--activation-checkpointing", action="store_true", help="recompute each unit's forward in backward")
    plan.add_argument("--schedule", metavar="SCHEDULE_JSON", default=None,
                      help="replay a schedule recorded by zeropp train --record-schedule on --hardware")
    plan.add_argument("--paper", action="store_true",
                      help="simulate the ZeRO++ paper's cluster (384 V100s) beside its published figures instead")
    plan.add_argument("--no-prefetch", action="store_true",
                      help="with --paper: record both schedules with prefetch off, so no gather overlaps compute")
    plan.add_argument("--out", default=None, metavar="JSON", help="with --paper: write the rows and the hardware here")
    plan.add_argument("--compare", metavar="THROUGHPUT_JSON", default=None,
                      help="compare predictions with a `zeropp bench throughput` result file")


def _add_dryrun(commands) -> None:
    dryrun = _subcommand(
        commands, "dryrun", "training steps as one rank of a large world, without accelerators (memory, bytes, syncs)",
        "Run real training steps of the engine as rank 0 of NODES x RANKS_PER_NODE ranks: a fake process group\n"
        "and the meta device in place of GPUs. Reports peak memory per phase beside the memory model, the bytes\n"
        "per phase and the host synchronisations of a step. Default: the ZeRO++ paper's 18B model on 384 GPUs.",
    )
    dryrun.add_argument("--models", default="40x6144",
                        help="comma-separated LAYERSxHIDDEN GPT shapes (heads of 128, vocabulary 50,000)")
    dryrun.add_argument("--layouts", default="24x16", help="comma-separated NODESxGPUS layouts")
    dryrun.add_argument("--tokens-per-rank", type=positive_int, default=1024, help="tokens per GPU per step")
    dryrun.add_argument("--variants", default="zero3,zero++", help="comma-separated: zero3, zero++ (fp16)")
    dryrun.add_argument("--no-activation-checkpointing", action="store_true",
                        help="keep every activation (the paper's runs recompute them)")
    dryrun.add_argument("--out", default=None, help="JSON file for the results")


def _add_study(commands) -> None:
    study = _subcommand(commands, "study", "long studies")
    study = study.add_subparsers(dest="study", required=True, metavar="STUDY")
    convergence = _subcommand(study, "convergence", "loss under ZeRO-3 and compressed variants, 2 nodes x 2")
    convergence.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size")
    convergence.add_argument("--steps", type=positive_int, default=1500, help="training steps per run")
    convergence.add_argument("--batch-per-rank", type=positive_int, default=8, help="sequences per rank per step")
    convergence.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    convergence.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate")
    convergence.add_argument("--eval-every", type=positive_int, default=100, help="steps between validation losses")
    convergence.add_argument("--eval-batches", type=positive_int, default=16, help="batches per validation loss")
    convergence.add_argument("--seeds", default="0,1,2",
                             help="comma-separated seeds; each runs ZeRO-3 and the main variants")
    convergence.add_argument("--layout", default="2x2", help="NODESxRANKS, for example 2x2 or 4x1")
    convergence.add_argument("--variants", default="all",
                             help="'all' (main variants at every seed, extras at the first) or a comma-separated "
                                  "list of zero3, zero++, two-hop, log-grid, deltas, zero++-log-grid (at every seed)")
    convergence.add_argument("--precision", default="fp32", choices=("auto", *PRECISIONS),
                             help="compute dtype of every run; auto: bf16 where the CPU computes it natively, "
                                  "else fp32 (the stored small-model study is fp32)")
    convergence.add_argument("--out", default="runs/convergence", help="folder for the runs, table and plot")
    convergence.add_argument("--report-only", action="store_true", help="rebuild table and plot from finished runs")


def _add_results(commands) -> None:
    results = _subcommand(commands, "results", "every stated figure at one commit, and the docs written from it",
                          "Run a tier of benchmarks at one clean commit into benchmarks/results/<tier>/ (run), write the\n"
                          "README's and docs/results' figure blocks from the stored JSON (render), or fail where a\n"
                          "block differs from them (check).")
    actions = results.add_subparsers(dest="results", required=True, metavar="ACTION")
    run = _subcommand(actions, "run", "run a tier's benchmarks (root: they shape emulated links)")
    run.add_argument("--tier", default="quick", choices=("quick", "full"),
                     help="quick: the README's figures at reduced repetitions (about 40 min on 2 cores); "
                          "full: everything docs/results states (hours)")
    run.add_argument("--allow-dirty", action="store_true",
                     help="run with uncommitted changes (every result is then marked not citable)")
    run.add_argument("--resume", action="store_true", help="skip the runs done at this commit, finish the rest")
    run.add_argument("--runs", default=None,
                     help="comma-separated names of the tier's runs to do now (default: all); the others can "
                          "follow with --resume at the same commit; without --resume the named runs start over "
                          "and the others' records at this commit stay")
    _subcommand(actions, "render", "rewrite the figure blocks of README.md and docs/results from the results")
    _subcommand(actions, "check", "exit 1 when a figure block differs from the stored results")


def _add_bench(commands) -> None:
    bench = _subcommand(commands, "bench", "benchmarks and reports")
    bench = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    comm = _subcommand(bench, "comm", "bytes per step of ZeRO-3 and ZeRO++ variants, measured and predicted")
    comm.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size")
    comm.add_argument("--layouts", default="2x2,2x4,4x2", help="comma-separated NODESxRANKS layouts")
    comm.add_argument("--out", default="runs/bench/comm.json", help="JSON file for the report")
    grad_error = _subcommand(bench, "grad-error", "qgZ schemes' error on real GPT gradients vs the exact mean")
    grad_error.add_argument("--steps", type=positive_int, default=32,
                            help="training steps whose gradients are measured")
    grad_error.add_argument("--out", default="runs/bench/gradient_error.json", help="JSON file for the report")
    _add_bench_throughput(bench)
    _add_bench_accumulation(bench)
    _add_bench_replan(bench)
    _add_bench_sweep(bench)
    rlhf = _subcommand(bench, "rlhf", "PPO iterations on the emulated cluster: ZeRO-3 per-token, ZeRO-3 pinned, "
                                      "ZeRO++ with MixZ++ (root)")
    rlhf.add_argument("--bandwidths", default="none,1000,200", help="comma-separated Mbit/s per link (none: unshaped)")
    rlhf.add_argument("--repetitions", type=positive_int, default=2, help="interleaved repetitions of each cell")
    rlhf.add_argument("--iterations", type=positive_int, default=6, help="PPO iterations per run (the first not counted)")
    rlhf.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size of all four models")
    rlhf.add_argument("--weights", default="runs/rlhf", help="folder with sft/ and reward/ (made if missing)")
    rlhf.add_argument("--out", default="runs/bench/rlhf", help="folder for rlhf.json and rlhf.md")
    rlhf.add_argument("--report-only", action="store_true", help="rebuild the report from the finished runs in --out")
    memory = _subcommand(bench, "memory", "peak memory per rank and the largest model: zeropp, FSDP2, DDP on 4 CPU ranks")
    memory.add_argument("--engines", default="zeropp-zero3,zeropp-zero++,fsdp2,ddp",
                        help="comma-separated: zeropp-zero3, zeropp-zero++, fsdp2, ddp")
    memory.add_argument("--hidden", type=positive_int, default=1024, help="hidden size of the Llama-style model")
    memory.add_argument("--layers", type=positive_int, default=24, help="decoder layers of the fixed model")
    memory.add_argument("--ram-fraction", type=positive_float, default=0.8,
                        help="share of the machine's RAM the search may fill with four ranks")
    memory.add_argument("--no-search", action="store_true", help="measure the fixed model only")
    memory.add_argument("--out", default="runs/bench/memory", help="folder for memory.json, memory.md and memory.png")
    faults = _subcommand(bench, "faults", "inject faults into real runs (link, node, disk, soak) and record the outcome")
    faults.add_argument("--scenarios", default="link_flap,link_down,node_killed,disk_full,soak",
                        help="comma-separated scenarios: link_flap, link_down, node_killed, disk_full, soak")
    faults.add_argument("--out", default="runs/bench/faults", help="folder for faults.json, faults.md and soak.png")
    quant = _subcommand(bench, "quant", "block quantization speed vs copy and error vs per-tensor scales")
    quant.add_argument("--numel", type=positive_int, default=1 << 22, help="values quantized per timing")
    quant.add_argument("--out", default="runs/bench/quant.json", help="JSON file for the report")


def _add_bench_throughput(bench) -> None:
    throughput = _subcommand(bench, "throughput", "tokens/s per variant and bandwidth on an emulated cluster")
    throughput.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes")
    throughput.add_argument("--ranks-per-node", type=positive_int, default=2, help="ranks per node")
    throughput.add_argument("--bandwidths", default="none,1000,200,50", help="Mbit/s per node link; none = unshaped")
    throughput.add_argument("--variants", default="zero3,qwz,hpz,qgz,qwz+qgz,zero++,zero++-two-hop,deltas,auto,fsdp2,"
                            "fsdp2-prefetch,fsdp2-reshard-node,fsdp2-hsdp,fsdp2-hsdp-prefetch,deepspeed-zero3,"
                            "deepspeed-zero3-small-buckets,deepspeed-zero++,deepspeed-zero++-small-buckets",
                            help="comma-separated variants; the DeepSpeed ones need `make deepspeed-setup`")
    throughput.add_argument("--repetitions", type=positive_int, default=3,
                            help="runs of each cell, in rotated order; the table shows their median and spread")
    throughput.add_argument("--model", default="medium", choices=MODEL_SIZES, help="GPT size")
    throughput.add_argument("--steps", type=positive_int, default=10, help="training steps per measurement")
    throughput.add_argument("--batch-per-rank", type=positive_int, default=4, help="sequences per rank per step")
    throughput.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence")
    throughput.add_argument("--precision", default="auto", choices=("auto", *PRECISIONS),
                            help="compute dtype; auto: bf16 where the CPU computes it natively, else fp32")
    throughput.add_argument("--out", default="runs/bench/throughput", help="folder for JSON, markdown and plot")
    throughput.add_argument("--report-only", action="store_true",
                            help="rebuild the report from the finished runs in --out (after a benchmark stopped early)")
    throughput.add_argument("--resume", action="store_true",
                            help="measure only the runs a stopped benchmark in --out left, with its settings")


def _add_bench_accumulation(bench) -> None:
    accumulation = _subcommand(bench, "accumulation", "tokens/s against micro-batches per optimizer step: node "
                               "accumulation, reducing every micro-step, DeepSpeed, FSDP2 HSDP, the unshaped limit")
    accumulation.add_argument("--bandwidths", default="200,50", help="comma-separated Mbit/s per node link")
    accumulation.add_argument("--accumulations", default="1,4,8", help="comma-separated micro-batches per step (k)")
    accumulation.add_argument("--variants", default="zero++,zero++-every-micro-step,deepspeed-zero++,fsdp2-hsdp",
                              help="comma-separated variants at each shaped bandwidth (ZeRO-3 unshaped is always run)")
    accumulation.add_argument("--repetitions", type=positive_int, default=3, help="runs of each cell, rotated order")
    accumulation.add_argument("--keep-weights-between-micro-steps", action="store_true",
                              help="zeropp's cells (the limit's too) keep every unit gathered through the accumulation")
    accumulation.add_argument("--steps", type=positive_int, default=6, help="optimizer steps per run")
    accumulation.add_argument("--untimed-steps", type=int, default=2, help="first steps left out of the median")
    accumulation.add_argument("--resume", action="store_true", help="measure what a stopped run in --out left")
    accumulation.add_argument("--report-only", action="store_true", help="rebuild the report from --out's JSON")
    _add_cluster_run(accumulation, "runs/bench/accumulation")


def _add_cluster_run(parser, out: str, batch_per_rank: bool = True) -> None:
    """The flags every emulated-cluster benchmark shares: layout, work per step, precision, output."""
    parser.add_argument("--nodes", type=positive_int, default=2, help="emulated nodes")
    parser.add_argument("--ranks-per-node", type=positive_int, default=2, help="ranks per node")
    parser.add_argument("--model", default="medium", choices=MODEL_SIZES, help="GPT size")
    if batch_per_rank:
        parser.add_argument("--batch-per-rank", type=positive_int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--precision", default="auto", choices=("auto", *PRECISIONS),
                        help="compute dtype; auto: bf16 where the CPU computes it natively, else fp32")
    parser.add_argument("--out", default=out, help="folder for the JSON, markdown and plot")


def _add_bench_replan(bench) -> None:
    replan = _subcommand(bench, "replan", "auto mode when the link changes mid-run, against fixed variants (root)")
    replan.add_argument("--from-mbit", type=positive_float, default=1000, help="link bandwidth at the start (Mbit/s)")
    replan.add_argument("--to-mbit", type=positive_float, default=50, help="link bandwidth after the change (Mbit/s)")
    replan.add_argument("--change-at", type=positive_int, default=15, help="steps rank 0 logged before the change")
    replan.add_argument("--steps", type=positive_int, default=45, help="training steps of the auto-mode run")
    replan.add_argument("--fixed-steps", type=positive_int, default=12, help="training steps of each fixed variant")
    _add_cluster_run(replan, "runs/bench/replan")
    replan.add_argument("--report-only", action="store_true", help="rebuild the report from the finished run in --out")


def _add_bench_sweep(bench) -> None:
    sweep = _subcommand(bench, "sweep", "speedup over ZeRO-3 against ZeRO-3's network share, one bandwidth (root)")
    sweep.add_argument("--bandwidth", type=positive_float, default=1000, help="link bandwidth (Mbit/s)")
    sweep.add_argument("--batches", default="1,2,4,8,16", help="comma-separated sequences per rank per step")
    sweep.add_argument("--variants", default="zero3,zero++", help="comma-separated zeropp variants; zero3 is the baseline")
    sweep.add_argument("--repetitions", type=positive_int, default=2, help="runs of each cell, in rotated order")
    sweep.add_argument("--steps", type=positive_int, default=12, help="training steps per run")
    _add_cluster_run(sweep, "runs/bench/sweep", batch_per_rank=False)


def explicitly_given(argv: list[str] | None) -> set[str]:
    """Destinations of the flags the user actually typed, even when typed with their
    default value: argv parsed again by a parser whose flag defaults are all suppressed,
    so only typed flags appear in the namespace."""
    parser = build_parser()
    for action in _all_actions(parser):
        if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _all_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from _all_actions(subparser)
