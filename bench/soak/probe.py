"""Readings of a running cluster: RSS, CPU time and open fds of its processes, free KV blocks of its workers.

Processes come from ``cluster.json`` (``processes`` plus the embedded etcd and, when this benchmark
started the cluster, the ``kvconductor up`` launcher); worker addresses from the etcd registry; loads
from ``kvconductor.v1.Worker/GetLoad`` over one long-lived channel per worker (so the probe itself
does not churn connections on the workers it measures).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvconductor.v1 import worker_pb2, worker_pb2_grpc
from services.common.instance_record import WORKER_ROLES
from services.common.registry import Registry

GET_LOAD_TIMEOUT_S = 5.0


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB from /proc/<pid>/status; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int | None:
    """Number of open file descriptors (entries of /proc/<pid>/fd); None when gone or not ours."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def cluster_processes(manifest: dict[str, Any], launcher_pid: int | None = None) -> dict[str, dict[str, Any]]:
    """{id: {"role", "pid"}} of every process of the cluster."""
    processes = {key: {"role": p["role"], "pid": int(p["pid"])} for key, p in manifest["processes"].items()}
    if etcd := manifest.get("embedded_etcd"):
        processes["etcd"] = {"role": "etcd", "pid": int(etcd["pid"])}
    if launcher_pid is not None:
        processes["launcher"] = {"role": "launcher", "pid": launcher_pid}
    return processes


def worker_addresses(manifest: dict[str, Any]) -> dict[str, str]:
    """{instance id: gRPC address} of every engine worker registered in etcd now."""
    with Registry(manifest["etcd"], manifest["cluster"]) as registry:
        records = registry.list()
    return {iid: rec.address for (role, iid), rec in sorted(records.items()) if role in WORKER_ROLES}


@dataclass
class Prober:
    """Takes samples of one cluster (see ``bench.soak.report`` for the shape)."""

    processes: dict[str, dict[str, Any]]
    workers: dict[str, str]
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._channels = {key: grpc.insecure_channel(address) for key, address in self.workers.items()}

    def load(self, key: str) -> dict[str, int] | None:
        """Free/total blocks and queue lengths of one worker; None when it does not answer."""
        try:
            reply = worker_pb2_grpc.WorkerStub(self._channels[key]).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=GET_LOAD_TIMEOUT_S
            )
        except grpc.RpcError:
            return None
        return {
            "free_blocks": reply.num_free_blocks,
            "total_blocks": reply.num_total_blocks,
            "running": reply.num_running,
            "waiting": reply.num_waiting,
            "reserved": reply.num_reserved,
        }

    def sample(self, label: str, t_s: float) -> dict[str, Any]:
        """One reading of every process and worker."""
        return {
            "label": label,
            "t_s": t_s,
            "wall": time.time(),
            "processes": {
                key: {**p, "rss_kib": rss_kib(p["pid"]), "fds": open_fds(p["pid"])} for key, p in self.processes.items()
            },
            "workers": {key: self.load(key) for key in self.workers},
        }

    def idle(self, baseline: dict[str, Any]) -> bool:
        """Every worker answers, has nothing queued, running or reserved, and is back to its baseline free blocks."""
        for key in self.workers:
            now, then = self.load(key), baseline["workers"].get(key)
            if now is None or then is None:
                return False
            if now["running"] or now["waiting"] or now["reserved"] or now["free_blocks"] != then["free_blocks"]:
                return False
        return True

    def close(self) -> None:
        """Close the gRPC channels."""
        for channel in self._channels.values():
            channel.close()
