"""``zeropp results run``: the benchmarks of one tier, one after another, at one commit.

The tree must be clean outside ``benchmarks/results/`` (``--allow-dirty`` runs anyway and
marks every file as not citable). ``manifest.json`` in the tier's folder records the
commit, the machine and each run's command, exit code and minutes; ``--resume`` skips the
runs it lists as done, resumes a run it lists as started or failed (a resumable
benchmark keeps what it had measured) and refuses to mix a second commit into the tier. Without
``--resume`` the runs named by ``--runs`` start over, and the records of the tier's other
runs stay when the manifest is at the same commit. A failed run is recorded and the next
one starts: nothing measured is lost to one failure.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from zeropp_tools.bench.provenance import RESULTS_FOLDER, provenance
from zeropp_tools.results.tiers import RUNS, Run

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def run_tier(tier: str, repository: Path, allow_dirty: bool = False, resume: bool = False,
             only: list[str] | None = None) -> int:
    """Run ``tier``'s benchmarks into ``repository/benchmarks/results/<tier>``; 0 when all succeeded.
    ``only``: the names of the runs to do now (the rest wait for a later ``--resume`` at the
    same commit), so a tier longer than one sitting is done piece by piece."""
    if tier not in RUNS:
        raise ValueError(f"--tier {tier!r} is not a tier; allowed values: {sorted(RUNS)}")
    runs = _selected(tier, only)
    source = provenance()
    if not source["clean_tree"] and not allow_dirty:
        raise ValueError("the tree has uncommitted changes outside benchmarks/results/ (git status): commit or stash "
                         "them, or pass --allow-dirty to mark this run's results as not citable")
    if any(run.needs_root for run in runs) and os.geteuid() != 0:
        needing = [run.name for run in runs if run.needs_root]
        raise ValueError(f"the {tier} tier's runs {needing} shape links between emulated nodes: run as root")
    folder = repository / RESULTS_FOLDER / tier
    manifest = _start_manifest(folder, tier, source, resume, restarting={run.name for run in runs})
    for index, run in enumerate(runs, 1):
        record = manifest["runs"].get(run.name, {})
        if record.get("exit_code") == 0:
            logger.info("[%d/%d] %s: done at this commit, skipped", index, len(runs), run.name)
            continue
        logger.info("[%d/%d] %s: about %.0f min, started %s", index, len(runs), run.name,
                    run.estimated_minutes, time.strftime("%H:%M"))
        # Recorded as started first: a run killed midway (a sitting's end) leaves this record,
        # and --resume then passes --resume on, so its benchmark keeps what it had measured.
        manifest["runs"][run.name] = {**record, "exit_code": None, "started": time.strftime("%Y-%m-%d %H:%M")}
        _write(folder, manifest)
        manifest["runs"][run.name] = _execute(run, folder, repository, resume=bool(record))
        _write(folder, manifest)
        logger.info("[%d/%d] %s: exit code %d after %.1f min", index, len(runs), run.name,
                    manifest["runs"][run.name]["exit_code"], manifest["runs"][run.name]["minutes"])
    failed = [name for name, record in manifest["runs"].items() if record["exit_code"] != 0]
    if failed:
        logger.error("failed: %s; their logs are in %s; rerun with --resume to retry them", failed, folder)
    return 1 if failed else 0


def _selected(tier: str, only: list[str] | None) -> tuple[Run, ...]:
    if only is None:
        return RUNS[tier]
    names = [run.name for run in RUNS[tier]]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise ValueError(f"--runs {','.join(unknown)}: not runs of the {tier} tier; allowed values: {names}")
    return tuple(run for run in RUNS[tier] if run.name in only)


def _start_manifest(folder: Path, tier: str, source: dict, resume: bool, restarting: set[str]) -> dict:
    """The tier's manifest: the stored one on ``resume``; otherwise a new one that keeps the
    records of runs outside ``restarting`` made at the same commit (``--runs`` redoes a part)."""
    path = folder / MANIFEST
    stored = json.loads(path.read_text()) if path.exists() else None
    same_commit = stored is not None and stored["provenance"]["git_commit"] == source["git_commit"]
    if resume and stored is not None:
        if not same_commit:
            raise ValueError(f"--resume: {path} holds runs at {stored['provenance']['git_commit']}, the tree is at "
                             f"{source['git_commit']}; one tier holds one commit: rerun without --resume")
        return stored
    kept = {name: record for name, record in stored["runs"].items() if name not in restarting} if same_commit else {}
    manifest = {"tier": tier, "provenance": source, "runs": kept}
    _write(folder, manifest)
    return manifest


def _execute(run: Run, folder: Path, repository: Path, resume: bool) -> dict:
    command = [sys.executable, "-m", "zeropp_tools.cli.main", *run.command(str(folder.relative_to(repository)), resume)]
    started = time.monotonic()
    with open(folder / f"{run.name}.log", "a" if resume else "w") as log:
        exit_code = subprocess.run(command, cwd=repository, stdout=log, stderr=subprocess.STDOUT).returncode
    return {"command": ["zeropp", *command[3:]], "exit_code": exit_code,
            "minutes": round((time.monotonic() - started) / 60, 1)}


def _write(folder: Path, manifest: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
