"""Command line: ``zeropp demo``, ``zeropp train`` and the tools (``zeropp --help``).

    zeropp demo                                  # ZeRO-3 vs ZeRO++ on 4 CPU ranks as 2 nodes x 2
    zeropp train --model medium --steps 500 --precision bf16 --world-size 4 --ranks-per-node 2
    torchrun --nproc-per-node 4 -m zeropp_tools.cli.main train ...   # join a torchrun world instead

Exit codes: 0 done, 2 a user mistake (bad flag, contradictory settings, missing file),
130 interrupted; a crash keeps Python's traceback and exit code 1.
"""

from __future__ import annotations

import logging
import signal
import sys

from .logs import configure_logging
from .parser import build_parser, explicitly_given

logger = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    configure_logging(arguments.log_level)
    try:
        return _dispatch(arguments, argv)
    except ValueError as error:
        logger.error("%s", error)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        logger.error("interrupted; everything started was stopped and removed")
        return EXIT_INTERRUPTED


def _dispatch(arguments, argv: list[str] | None) -> int:
    if arguments.command == "demo":
        from .demo import run_demo

        return run_demo(arguments)
    if arguments.command == "train":
        from .training import run_training

        return run_training(arguments, explicitly_given(argv))
    if arguments.command == "bench":
        return _run_bench(arguments)
    if arguments.command == "results":
        return _run_results(arguments)
    if arguments.command == "export":
        return _run_export(arguments)
    if arguments.command == "cluster":
        return _run_cluster(arguments)
    if arguments.command == "rlhf":
        from zeropp_tools.rlhf.cli import run_rlhf

        return run_rlhf(arguments)
    if arguments.command == "dryrun":
        from zeropp_tools import dryrun

        return dryrun.main(arguments)
    if arguments.command == "plan":
        from zeropp_tools import plan as planner

        return planner.main(arguments)
    from zeropp_tools.study import convergence

    return convergence.main(arguments)


def _run_cluster(arguments) -> int:
    from zeropp_tools.cluster import ClusterSpec
    from zeropp_tools.cluster.runner import run_on_cluster

    command = arguments.arguments[1:] if arguments.arguments[:1] == ["--"] else arguments.arguments
    if not command:
        raise ValueError("give the zeropp command to run after --, for example: zeropp cluster -- train --steps 20")
    spec = ClusterSpec(arguments.nodes, arguments.ranks_per_node, arguments.bandwidth, arguments.latency)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed job still removes its namespaces
    try:
        result = run_on_cluster(spec, command, arguments.timeout)
    except RuntimeError as error:  # the emulation could not start (no root, no ip netns)
        logger.error("%s", error)
        return EXIT_USER_ERROR
    logger.info(result["output"].rstrip("\n"))
    for node, counters in enumerate(result["link_bytes"]):
        logger.info("node %d link: sent %.3f MB, received %.3f MB, TCP segments resent %d", node,
                    counters["tx_bytes"] / 1e6, counters["rx_bytes"] / 1e6, counters["tcp_retransmitted_segments"])
    logger.info("exit codes %s; logs in %s", result["exit_codes"], result["logs"])
    return 0 if all(code == 0 for code in result["exit_codes"]) else 1


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_export(arguments) -> int:
    report = measure_export(arguments.checkpoint, arguments.output)
    logger.info(
        "wrote %s: %.1f MB of fp32 parameters; peak memory +%.1f MB (%.2fx the model)", report["output"],
        report["model_bytes"] / 1e6, report["peak_rss_increase_bytes"] / 1e6,
        report["peak_rss_increase_bytes"] / report["model_bytes"],
    )
    return 0


def measure_export(checkpoint, output) -> dict:
    """Export ``checkpoint`` to ``output`` and measure the peak memory it took (the
    checkpoint tests call this in a fresh process)."""
    from zeropp.checkpoint import export_consolidated, resolve_checkpoint
    from zeropp.checkpoint.export import model_bytes
    from zeropp.checkpoint.format import read_metadata
    from zeropp.memory import peak_rss_increase

    size = model_bytes(read_metadata(resolve_checkpoint(checkpoint)))
    written, peak = peak_rss_increase(lambda: export_consolidated(checkpoint, output))
    return {"output": str(written), "model_bytes": size, "peak_rss_increase_bytes": peak}


def _run_results(arguments) -> int:
    from pathlib import Path

    from zeropp_tools.bench.provenance import RESULTS_FOLDER
    from zeropp_tools.results.render import render_files
    from zeropp_tools.results.runner import run_tier

    repository = Path(__file__).resolve().parents[2]
    if arguments.results == "run":
        only = arguments.runs.split(",") if arguments.runs else None
        return run_tier(arguments.tier, repository, arguments.allow_dirty, arguments.resume, only)
    differences = render_files(repository, repository / RESULTS_FOLDER, write=arguments.results == "render")
    for difference in differences:
        logger.info("%s", difference)
    if arguments.results == "render":
        logger.info("rendered %d file(s) from %s", len(differences), RESULTS_FOLDER)
        return 0
    return 1 if differences else 0


def _run_bench(arguments) -> int:
    if arguments.bench == "comm":
        from zeropp_tools.bench import comm as benchmark
    elif arguments.bench == "throughput":
        from zeropp_tools.bench import throughput as benchmark
    elif arguments.bench == "accumulation":
        from zeropp_tools.bench import accumulation as benchmark
    elif arguments.bench == "grad-error":
        from zeropp_tools.bench import gradient_error as benchmark
    elif arguments.bench == "faults":
        from zeropp_tools.bench import faults as benchmark
    elif arguments.bench == "sweep":
        from zeropp_tools.bench import sweep as benchmark
    elif arguments.bench == "replan":
        from zeropp_tools.bench import replan as benchmark
    elif arguments.bench == "rlhf":
        from zeropp_tools.bench import rlhf as benchmark
    elif arguments.bench == "memory":
        from zeropp_tools.bench import memory as benchmark
    else:
        from zeropp_tools.bench import quantization as benchmark
    return benchmark.main(arguments)


if __name__ == "__main__":  # how torchrun starts each rank
    from zeropp.launch import exit_without_finalization

    # A torchrun rank whose teardown aborted would fail the whole job: see the function.
    exit_without_finalization(main() or 0)
