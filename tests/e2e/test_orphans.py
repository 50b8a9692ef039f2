"""A launcher killed with kill -9 leaves no cluster behind; a port still held is named, not crashed into."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from helpers import launch_cluster, stop_cluster

from cli.local_cluster import REPO


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_kill_9_of_the_launcher_stops_every_service_and_the_ports_serve_again(tmp_path, model_dir):
    first = launch_cluster(tmp_path / "first", model_dir, "prefill.node_count=1", "decode.node_count=1")
    assert (tmp_path / "first" / "etcd-data").is_dir()
    pids = {i: p["pid"] for i, p in first.manifest["processes"].items()}
    pids["etcd"] = first.manifest["embedded_etcd"]["pid"]
    try:
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
        deadline = time.monotonic() + 30  # SIGTERM from the kernel: each leaves etcd and exits (drain: nothing runs)
        while left := [i for i, pid in pids.items() if _alive(pid)]:
            assert time.monotonic() < deadline, f"still running 30 s after the launcher died: {left}"
            time.sleep(0.2)
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    etcd_port = first.manifest["embedded_etcd"]["client_port"]
    same = [f"gateway.port={first.rest.rsplit(':', 1)[1].split('/')[0]}",
            f'cluster.scheduler_endpoint="{first.conductor}"', f"cluster.etcd_port={etcd_port}"]  # fmt: skip
    second = launch_cluster(tmp_path / "second", model_dir, "prefill.node_count=1", "decode.node_count=1", *same)
    assert not (tmp_path / "first" / "etcd-data").exists()  # the killed run's etcd data: dropped, its logs kept
    assert (tmp_path / "first" / "up.log").exists() and (tmp_path / "second" / "etcd-data").is_dir()
    stop_cluster(second.process)
    assert not (tmp_path / "second" / "etcd-data").exists()  # a clean stop drops its own


def test_a_port_still_held_is_named_with_its_process(tmp_path, model_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "cli.main", "up", "--config", "deploy/config.toml", "--run-dir", str(tmp_path),
             "--set", f'model.path="{model_dir}"', "--set", f"gateway.port={port}"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"[gateway] port 127.0.0.1:{port} is in use (pid {os.getpid()}:" in result.stderr, result.stderr
    assert f"kill {os.getpid()}" in result.stderr
