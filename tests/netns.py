"""Network namespaces as hosts, for the multi-host tests: each host a namespace with a veth link to the root one.

The root namespace is the hub (an address on lo, so it stays up whichever link is cut); names and subnets are
unique per run (from the pid) and ``Net.close`` removes them. ``Processes`` runs ``kvconductor serve`` in a
namespace (``ip netns exec``) and stops what it started; ``hosts`` puts the two together with an etcd on the hub.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import wait_registered

from cli.etcd_server import EmbeddedEtcd, EtcdTls
from services.common.registry import EtcdAuth

ROOT = Path(__file__).resolve().parent.parent


def skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and veth pairs needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is missing"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class Net:
    """This run's namespaces, veth pairs, hub address and throttles; `close` undoes all of it."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.tag = f"kv{pid}"  # interface names stay within 15 characters
        self.octet = 100 + pid % 150
        self.hub = f"10.{self.octet}.0.1"
        self.hosts: dict[str, dict[str, str]] = {}
        self._undo: list[tuple[str, ...]] = []

    def setup(self, *hosts: str, rate: str = "", forward: bool = False) -> None:
        """One namespace per host name, each with a veth link to the root namespace (throttled to ``rate``);
        ``forward``: the hub routes between the hosts (IPv4 forwarding on this run's links only)."""
        _sh("ip", "addr", "add", f"{self.hub}/32", "dev", "lo")
        self._undo.append(("ip", "addr", "del", f"{self.hub}/32", "dev", "lo"))
        for index, name in enumerate(hosts, start=1):
            ns, outer, inner = f"{self.tag}-{name}", f"{self.tag}{name}r", f"{self.tag}{name}n"
            gateway, address = f"10.{self.octet}.{index}.1", f"10.{self.octet}.{index}.2"
            _sh("ip", "netns", "add", ns)
            self._undo.append(("ip", "netns", "del", ns))
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self._undo.append(("ip", "link", "del", outer))
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "addr", "add", f"{gateway}/24", "dev", outer)
            _sh("ip", "link", "set", outer, "up")
            if forward:
                _sh("sysctl", "-q", "-w", f"net.ipv4.conf.{outer}.forwarding=1")  # gone with the link
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "-n", ns, "route", "add", "default", "via", gateway)
            if rate:
                _sh("tc", "qdisc", "add", "dev", outer, "root", "tbf", "rate", rate, "burst", "64kb", "latency",
                    "400ms")  # fmt: skip
            self.hosts[name] = {"ns": ns, "outer": outer, "inner": inner, "address": address}

    def tx_bytes(self, name: str) -> int:
        """Bytes sent from the root namespace into host ``name`` (the KV direction)."""
        return int(Path(f"/sys/class/net/{self.hosts[name]['outer']}/statistics/tx_bytes").read_text())

    def cut(self, name: str) -> None:
        h = self.hosts[name]
        _sh("ip", "-n", h["ns"], "link", "set", h["inner"], "down")

    def restore(self, name: str) -> None:
        h = self.hosts[name]
        _sh("ip", "-n", h["ns"], "link", "set", h["inner"], "up")
        # Taking the device down dropped its routes; the default route must come back with it.
        _sh("ip", "-n", h["ns"], "route", "replace", "default", "via", h["address"].rsplit(".", 1)[0] + ".1")

    def close(self) -> list[str]:
        errors = []
        for command in reversed(self._undo):
            result = _sh(*command, check=False)
            if result.returncode != 0 and "Cannot find device" not in result.stderr:
                errors.append(f"{' '.join(command)}: {result.stderr.strip()}")
        self._undo.clear()
        return errors


class Processes:
    """Processes this test started, stopped by pid (SIGTERM, wait, SIGKILL)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, instance_id: str, args: list[str], netns: str | None = None) -> None:
        command = [sys.executable, "-m", "cli.main", "serve", role, "--id", instance_id, *args]
        if netns is not None:
            command = ["ip", "netns", "exec", netns, *command]  # `ip netns exec` execs: the pid is the server's
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with (self.log_dir / f"{instance_id}.log").open("ab") as log:
            self.children[instance_id] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
            )

    def log(self, instance_id: str) -> str:
        return (self.log_dir / f"{instance_id}.log").read_text(errors="replace")

    def stop(self, instance_id: str, timeout: float = 15.0) -> None:
        process = self.children.pop(instance_id)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        for instance_id in reversed(list(self.children)):
            self.stop(instance_id)

    def check_alive(self) -> None:
        for instance_id, process in self.children.items():
            if process.poll() is not None:
                raise RuntimeError(f"{instance_id} exited ({process.returncode}):\n{self.log(instance_id)[-3000:]}")

    def wait_registered(
        self, etcd_endpoint: str, servers: list[tuple[str, str]], timeout: float = 180.0, auth: EtcdAuth | None = None
    ) -> None:
        """Wait until every (role, instance_id) is registered in etcd (``auth``: its TLS files); fail at once if a
        process exited."""
        registry = SimpleNamespace(manifest={"etcd": [etcd_endpoint], "cluster": "local"})
        deadline = time.monotonic() + timeout
        for role, instance_id in servers:
            while True:
                self.check_alive()
                try:
                    wait_registered(registry, role, instance_id, timeout=2, auth=auth)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise


@contextmanager
def hosts(
    scratch: Path,
    *names: str,
    rate: str = "",
    forward: bool = False,
    etcd_tls: Callable[[Net], EtcdTls] | None = None,
) -> Iterator[tuple[Net, Processes, EmbeddedEtcd]]:
    """Namespaces ``names`` linked to the hub, an etcd on the hub and the test's processes, all torn down whatever
    happens (namespaces, links and addresses checked gone); the test is skipped where namespaces cannot be built.

    ``forward``: as in ``Net.setup``. ``etcd_tls(net)``, called once the namespaces have their addresses: etcd's
    TLS (HTTPS, client certificates required; its certificate names ``net.hub``)."""
    net = Net()
    processes = Processes(scratch)
    etcd: EmbeddedEtcd | None = None
    try:
        try:
            net.setup(*names, rate=rate, forward=forward)
        except RuntimeError as e:
            pytest.skip(f"cannot build the namespaces here: {e}")
        etcd = EmbeddedEtcd(run_dir=scratch / "etcd", host=net.hub, tls=etcd_tls(net) if etcd_tls else None)
        etcd.start()
        yield net, processes, etcd
    finally:
        processes.stop_all()
        if etcd is not None:
            etcd.close()
        errors = net.close()
        assert not errors, f"teardown left network state behind: {errors}"
