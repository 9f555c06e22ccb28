"""Where a result came from: the git commit and the machine, stored beside every figure."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def provenance() -> dict:
    return {"git_commit": _git_commit(), "machine": machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


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


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip()
        return result.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


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
