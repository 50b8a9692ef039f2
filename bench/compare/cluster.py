"""A local cluster for benchmarks: ``kvconductor up`` as a subprocess on free loopback ports.

The launcher writes ``cluster.json`` (with the REST base URL) into its run dir once every process is
healthy; SIGTERM stops it and it stops its own children. Only the process started here is signalled.
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

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
FREE_PORTS = ("cluster.etcd_port=0", 'cluster.scheduler_endpoint="127.0.0.1:0"', "gateway.port=0")
COLOCATED = ("prefill.node_count=0", "decode.node_count=0", "colocated.node_count=2")
DISAGGREGATED = ("prefill.node_count=1", "decode.node_count=1", "colocated.node_count=0")


@dataclass
class RunningCluster:
    """A started cluster: its launcher process, run dir, REST URL and start-up time."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    rest: str
    startup_s: float


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _start(config: str, overrides: Sequence[str], run_dir: Path) -> RunningCluster:
    args = [sys.executable, "-m", "services.cli", "up", "--config", config, "--run-dir", str(run_dir)]
    for override in (*FREE_PORTS, *overrides):
        args += ["--set", override]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    manifest = run_dir / "cluster.json"
    while not manifest.exists():
        if process.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
            _stop(process)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"kvconductor up failed (log {log_path}): " + " | ".join(tail))
        time.sleep(0.25)
    rest = json.loads(manifest.read_text())["rest"]
    return RunningCluster(process, run_dir, rest, time.monotonic() - t0)


@contextmanager
def local_cluster(config: str, overrides: Sequence[str], run_dir: Path) -> Iterator[RunningCluster]:
    """Start a cluster, yield it, stop it (also on errors and Ctrl-C)."""
    cluster = _start(config, overrides, run_dir)
    try:
        yield cluster
    finally:
        _stop(cluster.process)
