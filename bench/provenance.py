"""Where a benchmark's results come from and where they go.

Every result records the code it ran (``code``: the commit, and whether the tree had uncommitted
changes) and the exact command. A run writes into a fresh folder under ``runs/bench/`` unless ``--out``
names another: committed results under ``bench/results/`` change only when asked for by name.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_state() -> str:
    """HEAD and whether the working tree had changes: the code the run ran."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        # Committed results are outputs, not code: a run that rewrites them leaves the next run's code clean.
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno", "--", ".", ":!bench/results"], cwd=REPO,
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def fresh_out(kind: str) -> str:
    """A new folder for one run's outputs: ``runs/bench/<kind>-<timestamp>``."""
    return str(REPO / "runs" / "bench" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, its API key hidden."""
    words = list(sys.argv[1:] if argv is None else argv)
    for i, word in enumerate(words):
        if word == "--api-key" and i + 1 < len(words):
            words[i + 1] = "***"
        elif word.startswith("--api-key="):
            words[i] = "--api-key=***"
    return "kvconductor " + shlex.join(words)
