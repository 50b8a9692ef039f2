"""A whole local cluster in a subprocess (``kvconductor up``), for tests, benchmarks and scripts.

``kvconductor up`` writes ``cluster.json`` into its run dir once every process is healthy (REST URL,
Conductor address, etcd, process ids, the arguments that start one more process). SIGTERM stops it, and
it stops its own children. Only the process started here is ever signalled, and it is stopped however
the caller leaves, start-up included (a Ctrl-C while a cluster is still coming up).
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

REPO = Path(__file__).resolve().parents[1]
FREE_PORTS = ("cluster.etcd_port=0", 'cluster.scheduler_endpoint="127.0.0.1:0"', "gateway.port=0")
# The small random-weight model the tests and the scheduling benchmarks serve (fast on two cores).
TINY_MODEL = ('model.path="models/tiny-llama"', 'model.name="tiny-llama"', 'model.source="random"')
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


@dataclass
class LocalCluster:
    """A running ``kvconductor up``: its process, run dir, cluster.json and start-up time."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    manifest: dict[str, Any]
    startup_s: float

    @property
    def rest(self) -> str:
        """The REST base URL (ends in /v1)."""
        return str(self.manifest["rest"])

    @property
    def conductor(self) -> str:
        """The Conductor's gRPC address."""
        return str(self.manifest["conductor"])

    def pid(self, instance_id: str) -> int:
        """Process id of one of the cluster's processes."""
        return int(self.manifest["processes"][instance_id]["pid"])


def start(
    config: str, overrides: Sequence[str], run_dir: Path, ready_timeout_s: float = READY_TIMEOUT_S
) -> LocalCluster:
    """Start ``kvconductor up`` on free loopback ports and wait for cluster.json (stopped on any failure)."""
    args = [sys.executable, "-m", "cli.main", "up", "--config", config, "--run-dir", str(run_dir)]
    for override in (*FREE_PORTS, *overrides):
        args += ["--set", override]
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        manifest = run_dir / "cluster.json"
        while not manifest.exists():
            if process.poll() is not None or time.monotonic() - t0 > ready_timeout_s:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-20:]
                raise RuntimeError(f"kvconductor up failed (log {log_path}):\n" + "\n".join(tail))
            time.sleep(0.25)
        time.sleep(0.1)  # the launcher writes the file in one call; let a partial write finish
        return LocalCluster(process, run_dir, json.loads(manifest.read_text()), time.monotonic() - t0)
    except BaseException:
        stop(process)
        raise


def stop(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM a process and wait (a launcher stops its children); SIGKILL it if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def local_cluster(config: str, overrides: Sequence[str], run_dir: Path) -> Iterator[LocalCluster]:
    """Start a cluster, yield it, stop it (also on errors and Ctrl-C)."""
    cluster = start(config, overrides, run_dir)
    try:
        yield cluster
    finally:
        stop(cluster.process)
