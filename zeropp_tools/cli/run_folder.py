"""An output folder that does not outlive a failed run with nothing in it."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


@contextmanager
def run_folder(out: Path):
    """Create ``out`` (and missing parents) for a run. If the run raises, the folders this
    call created are removed again when they hold nothing but an empty metrics file; a
    folder with metrics lines or anything else (a checkpoint) is kept and named in the log,
    so a failure never loses work and never leaves an empty run folder behind."""
    out = Path(out)
    first_created = _first_missing(out)
    metrics_before = _fingerprint(out / METRICS_FILE)
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:  # KeyboardInterrupt too: an interrupted run cleans up the same way
        _after_failure(out, first_created, metrics_before)
        raise


def _first_missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist yet, or None."""
    missing = None
    for candidate in [folder, *folder.parents]:
        if candidate.exists():
            break
        missing = candidate
    return missing


def _fingerprint(path: Path) -> tuple[int, int] | None:
    """(modification time, size) of a file, to tell this run's metrics from an older run's."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


def _after_failure(out: Path, first_created: Path | None, metrics_before: tuple[int, int] | None) -> None:
    metrics = out / METRICS_FILE
    lines = _count_lines(metrics) if _fingerprint(metrics) != metrics_before else 0
    if lines:
        logger.warning("the run failed after %d step(s); their metrics are kept in %s", lines, metrics)
        return
    if first_created is None:
        return  # the folder was there before this run: whatever it holds is not ours to remove
    if metrics.exists():
        metrics.unlink()  # empty: opened by the run, nothing written
    leftovers = sorted(path.name for path in out.iterdir())
    if leftovers:
        logger.warning("the run failed; kept %s, which holds %s", out, ", ".join(leftovers))
        return
    _remove_empty_chain(out, first_created)


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path) as file:
        return sum(1 for line in file if line.strip())


def _remove_empty_chain(folder: Path, outermost: Path) -> None:
    """rmdir ``folder`` and its parents up to ``outermost``: the folders this run made.
    rmdir refuses a non-empty folder, so a file someone else put there stops it."""
    for candidate in [folder, *folder.parents]:
        try:
            candidate.rmdir()
        except OSError:
            return
        if candidate == outermost:
            return
