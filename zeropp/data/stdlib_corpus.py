"""A byte-level corpus made of the Python standard library's own ``.py`` sources.

Present on every machine that runs Python, so nothing is downloaded. Files are read in
sorted order and concatenated; the first 90% of the bytes train, the rest validate.
Batches are drawn from a generator seeded by (seed, split, step), so a run's data order is
a pure function of its step number: resuming or re-sharding never changes it.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SPLITS = ("train", "validation")


def load_stdlib_corpus(max_bytes: int = 16_000_000) -> torch.Tensor:
    """uint8 tensor of at most ``max_bytes`` bytes of standard-library source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(_python_sources(root)):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    joined = b"".join(chunks)[:max_bytes]
    if len(joined) < 10_000:
        raise ValueError(f"found only {len(joined)} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


def _python_sources(root: Path) -> list[Path]:
    """What ``root.rglob("*.py")`` finds, without walking site-packages: there it is most of
    the files (11,000 of 13,000 with a few packages installed) and most of a second per
    call, paid by every rank of every training job."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "site-packages"]
        found.extend(Path(folder, name) for name in fnmatch.filter(files, "*.py"))
    return found


@dataclass
class ByteCorpus:
    data: torch.Tensor  # [num_bytes] uint8
    train_fraction: float = 0.9

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise ValueError(f"split {name!r} is unknown; allowed values: {list(SPLITS)}")
        cut = int(self.data.numel() * self.train_fraction)
        return self.data[:cut] if name == "train" else self.data[cut:]

    def global_batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int = 0):
        """Inputs and targets, each [batch_size, seq_len] int64, for ``step``."""
        data = self.split(split)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + SPLITS.index(split) * 7919 + step)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

    def rank_batch(self, split, step, batch_per_rank, seq_len, rank, world_size, seed=0):
        """This rank's rows of the global batch of ``batch_per_rank * world_size`` rows."""
        inputs, targets = self.global_batch(split, step, batch_per_rank * world_size, seq_len, seed)
        rows = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
        return inputs[rows], targets[rows]
