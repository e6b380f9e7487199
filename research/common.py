"""Paths and helpers every research script shares: where records and plots go, and the source commit a record names.

Records (one JSON per run, checkpoints of runs in progress) live under ``research/results/<experiment>/``; the
plots and tables that docs/results.md shows live in ``docs/results/`` and in docs/results.md itself.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "research" / "results"  # run records and committed checkpoints, one folder per experiment
DOCS = ROOT / "docs" / "results.md"  # the page the reports write their sections into
PLOTS = DOCS.parent / "results"  # the PNGs that page shows (``<docs folder>/results/<section>.png``)
# What a record's source commit covers: the code (records being written under research/results do not count)
CODE_PATHS = ("modeling_bst", "training", "research", ":(exclude)research/results")


def plot_path(docs: Path, section: str) -> Path:
    """The PNG of ``section`` beside the page ``docs`` (``docs/results.md`` -> ``docs/results/<section>.png``)."""
    return Path(docs).parent / "results" / f"{section}.png"


def source_commit() -> str:
    """The source commit (``+dirty`` with local changes to the code), or ``$BST_SOURCE_COMMIT`` where it is set: a
    copy of the tree sent to an accelerator machine may carry no git metadata, or stale metadata (the device tool's
    copy reported the session's first commit with the later commits' changes as local edits)."""
    if os.environ.get("BST_SOURCE_COMMIT"):
        return os.environ["BST_SOURCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *CODE_PATHS],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
