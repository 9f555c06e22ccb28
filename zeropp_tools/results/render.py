"""Figures rendered, not typed: a block of a markdown file between
``<!-- results: NAME -->`` and ``<!-- /results -->`` holds what the section NAME of
:mod:`.sections` writes from the stored JSON, and nothing else.

``zeropp results render`` rewrites the blocks; ``zeropp results check`` (and the test suite)
fails when a block differs from what the stored results give, or when a block cites a
result from a dirty tree or results from more than one commit.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

BLOCK = re.compile(r"(?P<open><!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- /results -->)", re.S)
# The files whose figures come from benchmarks/results/, relative to the repository.
RENDERED_FILES = ("README.md", "docs/results/bytes.md", "docs/results/throughput.md",
                  "docs/results/accumulation.md", "docs/results/memory.md", "docs/results/convergence.md", "docs/results/rlhf.md",
                  "docs/results/simulator.md")


class StoredResults:
    """The JSON files under one results folder, read through :meth:`load`, which holds every
    block to one clean commit."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.cited: dict[str, str] = {}  # file -> the commit it was measured at

    def exists(self, relative: str) -> bool:
        return (self.folder / relative).exists()

    def load(self, relative: str) -> dict:
        path = self.folder / relative
        if not path.exists():
            raise ValueError(f"{path} does not exist: run `make results` (or `zeropp results run`) first")
        report = json.loads(path.read_text())
        source = report.get("provenance", report)  # faults.json keeps its provenance at the top
        commit = source.get("git_commit")
        if not commit or commit.endswith("-dirty") or source.get("clean_tree") is False:
            raise ValueError(f"{path} was measured at {commit or 'no recorded commit'}, not at a clean commit: "
                             f"it cannot be cited; rerun it with `make results`")
        self.cited[relative] = commit
        return report

    def commit(self) -> str:
        """The one commit of everything loaded since the last call."""
        commits = set(self.cited.values())
        cited, self.cited = self.cited, {}
        if len(commits) > 1:
            raise ValueError(f"one block cites results from {len(commits)} commits: {cited}")
        return commits.pop() if commits else ""


def render_text(text: str, results: StoredResults) -> str:
    from zeropp_tools.results.sections import SECTIONS

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in SECTIONS:
            raise ValueError(f"<!-- results: {name} --> names no section; known: {sorted(SECTIONS)}")
        body = SECTIONS[name](results).rstrip("\n") + "\n"
        results.commit()
        return match["open"] + body + match["close"]

    return BLOCK.sub(replace, text)


def render_files(repository: Path, results_folder: Path, write: bool) -> list[str]:
    """Render every block of :data:`RENDERED_FILES`; the differences found (unified diffs),
    written back when ``write``."""
    differences = []
    for relative in RENDERED_FILES:
        path = repository / relative
        text = path.read_text()
        rendered = render_text(text, StoredResults(results_folder))
        if rendered != text:
            differences.append("".join(difflib.unified_diff(
                text.splitlines(keepends=True), rendered.splitlines(keepends=True), relative, f"{relative} (rendered)")))
            if write:
                path.write_text(rendered)
    return differences
