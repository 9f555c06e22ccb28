"""Where a result came from: the git commit and the machine, stored beside every figure."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


# Results a run writes into the repository do not make the tree it ran from dirty.
RESULTS_FOLDER = "benchmarks/results"


def provenance() -> dict:
    commit, clean = _git_state()
    return {"git_commit": commit if clean or commit is None else commit + "-dirty", "clean_tree": clean,
            "machine": machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "command": shlex.join([_program(), *sys.argv[1:]])}


def _program() -> str:
    name = Path(sys.argv[0]).name
    return "zeropp" if name == "main.py" and "zeropp_tools" in sys.argv[0] else name


def machine() -> dict:
    info = {"cpu_model": platform.processor(), "cpu_flags": [], "cores": len(os.sched_getaffinity(0))}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
                break
    return info


def _git_state() -> tuple[str | None, bool]:
    """(HEAD's commit, whether the tree outside the results folder is clean); (None, False)
    outside a git checkout."""
    try:
        commit = _git("rev-parse", "HEAD").strip()
        changes = _git("status", "--porcelain", "--", ":(top)", f":(top,exclude){RESULTS_FOLDER}").strip()
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return commit, not changes


def _git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent).stdout


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_precision() -> tuple[str, str]:
    """("bf16" or "fp32", why): bf16 where the hardware computes it natively (a GPU, or a
    CPU with AVX512-BF16 or AMX); elsewhere bf16 is emulated, several times slower than fp32,
    and a benchmark in it would measure the emulation instead of the communication."""
    if torch.cuda.is_available():
        return "bf16", f"GPU {torch.cuda.get_device_name()}"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in machine()["cpu_flags"]]
    if native:
        return "bf16", f"the CPU has {', '.join(native)}"
    return "fp32", "the CPU has neither AVX512-BF16 nor AMX: bf16 would be emulated"


def chosen_precision(flag: str) -> tuple[str, str]:
    """(precision, why) for a benchmark's ``--precision`` flag: ``auto`` asks the hardware."""
    return native_precision() if flag == "auto" else (flag, "given")
