"""The soak's own cluster: ``kvconductor up`` on free ports, stopped on every way out.

Like ``bench.compare.cluster.local_cluster`` (same launcher, ports and overrides), except that the
wait for ``cluster.json`` is inside the ``try``: a Ctrl-C or SIGTERM during the start-up (which takes
20-60 s on a busy machine) stops the launcher too. Only the process started here is signalled; the
launcher stops its own children.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.compare.cluster import FREE_PORTS, READY_TIMEOUT_S, REPO, STOP_TIMEOUT_S


@dataclass
class OwnCluster:
    """A started cluster: the launcher, its run dir, its cluster.json and the start-up time."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    manifest: dict[str, Any]
    startup_s: float


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher and wait for it (it stops its children); SIGKILL it if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def own_cluster(config: str, overrides: Sequence[str], run_dir: Path) -> Iterator[OwnCluster]:
    """Start ``kvconductor up``, wait until it wrote cluster.json, yield, stop it (always)."""
    args = [sys.executable, "-m", "services.cli", "up", "--config", config, "--run-dir", str(run_dir)]
    for override in (*FREE_PORTS, *overrides):
        args += ["--set", override]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        manifest_path = run_dir / "cluster.json"
        while not manifest_path.exists():
            if process.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"kvconductor up failed (log {log_path}): " + " | ".join(tail))
            time.sleep(0.25)
        time.sleep(0.1)  # the launcher writes the file in one call; let a partial write finish
        manifest = json.loads(manifest_path.read_text())
        yield OwnCluster(process, run_dir, manifest, time.monotonic() - t0)
    finally:
        stop(process)
