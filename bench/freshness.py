"""``kvconductor bench results``: which committed results still measure today's code, and re-running the rest.

Every result JSON under ``bench/results/`` (any depth) names the commit it ran (``code``) and its command. The
code a result measures is every file its command's entry point reaches by imports (``bench.imports``; a
cluster benchmark reaches the processes it starts too). A result is *stale* when a commit since its own
changed one of those files: its numbers may no longer be what the code does. ``--rerun`` runs a result's
recorded command again, writing over the committed files (its ``--out`` / ``--json`` point at them); the
write-up beside it then needs its prose checked (``tests/unit/test_bench_results.py`` says where).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.imports import reached_files
from bench.provenance import REPO

RESULTS = REPO / "bench" / "results"
# The entry modules of the `kvconductor bench` subcommands (bench/commands.py)
SUBCOMMANDS = {"serve": "bench.serve.cli", "compare": "bench.compare.cli"}
COMMANDS = {"plan": "bench.plan"}  # kvconductor commands beside bench that write results


@dataclass(frozen=True)
class Result:
    """One committed result and what became of the code it measured."""

    path: Path
    code: str  # the commit it ran
    command: str
    changes: tuple[str, ...] | None  # commits since `code` that touched its code (None: `code` not in history)

    @property
    def status(self) -> str:
        """``fresh``, ``stale`` or ``unknown`` (its commit is not in this clone's history)."""
        if self.changes is None:
            return "unknown"
        return "stale" if self.changes else "fresh"


def entry_module(command: str) -> str:
    """The module a recorded command runs: ``python -m M ...`` -> M, ``kvconductor bench NAME ...`` or
    ``kvconductor plan ...`` -> its CLI; a wrapper's (``python -m bench.compare.cpu ... -- COMMAND``): COMMAND's."""
    words = shlex.split(command)
    if words[:2] == ["python", "-m"] and "--" in words:
        return entry_module(shlex.join(words[words.index("--") + 1 :]))
    if words[:2] == ["python", "-m"]:
        return words[2]
    if words and Path(words[0]).name == "kvconductor":  # as installed, or a venv's own (.venv/bin/kvconductor)
        if words[1:2] and words[1] in COMMANDS:
            return COMMANDS[words[1]]
        if words[1:2] == ["bench"] and words[2:3] and words[2] in SUBCOMMANDS:
            return SUBCOMMANDS[words[2]]
    raise ValueError(
        f"cannot tell what {command!r} runs: record `python -m MODULE ...`, `kvconductor bench ...` "
        "or `kvconductor plan ...`"
    )


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)


def examine(path: Path) -> Result:
    """The result at ``path`` and the commits since its own that changed the code it measures."""
    record = json.loads(path.read_text())
    code, command = str(record.get("code", "")), str(record.get("command", ""))
    files = sorted(str(f.relative_to(REPO)) for f in reached_files([entry_module(command)]))
    if _git("cat-file", "-e", f"{code}^{{commit}}").returncode != 0:
        return Result(path, code, command, None)
    log = _git("log", "--format=%h", f"{code}..HEAD", "--", *files)
    return Result(path, code, command, tuple(log.stdout.split()))


def committed_results() -> list[Path]:
    """Every result JSON under bench/results, at any depth."""
    return sorted(RESULTS.rglob("*.json"))


def rerun_command(result: Result) -> list[str]:
    """The recorded command, run by this Python, writing where the committed result lies."""
    words = shlex.split(result.command)
    if "***" in words:
        raise ValueError(f"{result.path}: its command hides a secret; run it by hand")
    for flag, target in (("--out", result.path.parent), ("--json", result.path)):
        for i in [i for i, word in enumerate(words[:-1]) if word == flag]:  # a wrapper's and its command's
            words[i + 1] = str(target.relative_to(REPO))
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return [sys.executable, "-m", "cli.main", *words[1:]]  # kvconductor ...


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvconductor bench results``."""
    p.add_argument("--stale", action="store_true", help="list only the results whose code changed since they ran")
    p.add_argument("--rerun", nargs="*", metavar="PATH", default=None,
                   help="run these results' commands again, writing over them (no PATH: every stale one)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """List the committed results with their status; re-run some on request."""
    results = [examine(p) for p in committed_results()]
    for r in results:
        if args.stale and r.status == "fresh":
            continue
        since = f" ({len(r.changes)} commits since changed its code: {' '.join(r.changes[:5])})" if r.changes else ""
        print(f"{r.status:8} {r.path.relative_to(REPO)}  code {r.code}{since}")
        print(f"         {r.command}")
    if args.rerun is None:
        return 0
    chosen = [examine(Path(p).resolve()) for p in args.rerun] or [r for r in results if r.status == "stale"]
    for i, r in enumerate(chosen, 1):
        command = rerun_command(r)
        print(f"[{i}/{len(chosen)}] {r.path.relative_to(REPO)}: {shlex.join(command)}", flush=True)
        if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
            print(f"failed: {r.path.relative_to(REPO)}", file=sys.stderr)
            return 1
    print("re-run; now check each write-up against its JSON: .venv/bin/pytest tests/unit/test_bench_results.py")
    return 0
