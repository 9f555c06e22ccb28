"""The benchmark runs of each tier of ``zeropp results run``: the quick tier measures the
README's figures at reduced repetitions (about 40 minutes on 2 cores); the full tier
everything docs/results states (about 18 hours on 2 cores, most of it the ten-seed
convergence study and the throughput matrix; resumable run by run)."""

from __future__ import annotations

from dataclasses import dataclass

QUICK = "quick"
FULL = "full"
TIERS = (QUICK, FULL)

# The peers at the set-ups that were fastest in earlier full runs (FSDP2 HSDP without extra
# prefetching, DeepSpeed ZeRO++ with its default buckets); the full tier runs them all.
QUICK_PEERS = "fsdp2-hsdp,deepspeed-zero++"
ALL_PEERS = "fsdp2-hsdp,fsdp2-hsdp-prefetch,deepspeed-zero++,deepspeed-zero++-small-buckets"
FIXED_SCHEMES = "zero3,qwz,hpz,qgz,qwz+qgz,zero++,zero++-two-hop,zero++-log-grid,deltas"
AUTO_CHOICES = "zero3,hpz,qwz,qgz,qwz+qgz,zero++,zero++-two-hop"  # the schemes auto mode chooses among


@dataclass(frozen=True)
class Run:
    """One benchmark: ``zeropp`` with ``arguments`` ({out} is replaced by the tier's folder)."""

    name: str
    arguments: tuple[str, ...]
    needs_root: bool
    estimated_minutes: float
    resumable: bool = False  # takes --resume to finish what a stopped run of it left

    def command(self, folder: str, resume: bool = False) -> list[str]:
        arguments = [argument.replace("{out}", folder) for argument in self.arguments]
        return arguments + ["--resume"] if resume and self.resumable else arguments


def _run(name: str, arguments: str, needs_root: bool, estimated_minutes: float, resumable: bool = False) -> Run:
    return Run(name, tuple(arguments.split()), needs_root, estimated_minutes, resumable)


QUICK_RUNS = (
    _run("comm", "bench comm --layouts 2x2,2x4 --out {out}/comm.json", False, 2),
    _run("throughput", f"bench throughput --bandwidths none,1000,200 --variants zero3,zero++,{QUICK_PEERS} "
                       "--repetitions 2 --steps 10 --out {out}/throughput", True, 14),
    _run("accumulation", "bench accumulation --bandwidths 200,50 --accumulations 8 --repetitions 2 --steps 4 "
                         "--untimed-steps 1 --out {out}/accumulation", True, 16),
    _run("memory", "bench memory --engines zeropp-zero3,fsdp2 --no-search --out {out}/memory", False, 7),
)

FULL_RUNS = (
    _run("comm", "bench comm --layouts 2x2,2x4,4x2 --out {out}/comm.json", False, 3),
    _run("quantization", "bench quant --out {out}/quant.json", False, 2),
    _run("gradient-error", "bench grad-error --out {out}/gradient_error.json", False, 5),
    _run("throughput", f"bench throughput --bandwidths none,1000,200,50 --variants {FIXED_SCHEMES},{ALL_PEERS} "
                       "--repetitions 3 --steps 30 --out {out}/throughput", True, 180, resumable=True),
    # Auto mode's trials take up to 32 steps: 100-step runs beside the schemes it chooses among.
    _run("auto", f"bench throughput --bandwidths none,1000,200 --variants {AUTO_CHOICES},auto "
                 "--repetitions 3 --steps 100 --out {out}/auto", True, 120, resumable=True),
    _run("auto-50", f"bench throughput --bandwidths 50 --variants {AUTO_CHOICES},auto "
                    "--repetitions 3 --steps 30 --out {out}/auto_50", True, 60, resumable=True),
    _run("replan", "bench replan --out {out}/replan", True, 15),
    _run("sweep", "bench sweep --repetitions 3 --out {out}/sweep", True, 40),
    _run("accumulation", "bench accumulation --out {out}/accumulation", True, 60, resumable=True),
    _run("memory", "bench memory --out {out}/memory", False, 40),
    _run("faults", "bench faults --out {out}/faults", True, 20),
    _run("rlhf", "bench rlhf --out {out}/rlhf", True, 40),
    # The simulator against the cluster: each scheme's schedule replayed on the calibration.
    _run("simulator", "bench throughput --bandwidths none,1000,200,50 --variants zero3,zero++,zero++-two-hop,log-grid "
                      "--repetitions 3 --steps 10 --out {out}/simulator/throughput", True, 35, resumable=True),
    _run("paper", "plan --paper --out {out}/simulator/paper.json", False, 2),
    _run("paper-no-prefetch", "plan --paper --no-prefetch --out {out}/simulator/paper-no-prefetch.json", False, 2),
    _run("convergence", "study convergence --seeds 0,1,2,3,4,5,6,7,8,9 --variants zero3,zero++,log-grid,deltas "
                         "--out {out}/convergence", False, 440),
)

RUNS = {QUICK: QUICK_RUNS, FULL: FULL_RUNS}
