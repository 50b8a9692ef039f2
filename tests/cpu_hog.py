"""Run a command while a busy loop spins on every core: a noisy neighbour for `make test-contended`.

    python tests/cpu_hog.py [--seconds S] [--cores N] -- COMMAND ...

Each hog is a separate process that burns CPU until the command ends, or for at most ``--seconds``
(a hog never outlives a crashed runner by long). The command sees ``CPU_HOGS`` (the number of hogs) in its
environment, for the few assertions whose margins are measured separately under contention. The exit
status is the command's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

HOGS_ENV = "CPU_HOGS"


def _spin(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3600.0, help="upper bound on each hog's life")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="hogs to start (default: every core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    hogs = [multiprocessing.Process(target=_spin, args=(args.seconds,), daemon=True) for _ in range(args.cores)]
    for hog in hogs:
        hog.start()
    print(f"cpu_hog: {len(hogs)} busy loops running; {' '.join(command)}", flush=True)
    start = time.monotonic()
    try:
        return subprocess.call(command, env={**os.environ, HOGS_ENV: str(len(hogs))})
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()
        print(f"cpu_hog: the command took {time.monotonic() - start:.0f} s under contention", flush=True)


if __name__ == "__main__":
    sys.exit(main())
