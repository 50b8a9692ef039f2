"""Third-party front ends for the benchmark's workers: ``sglang-router`` and ``vllm-router`` from PyPI.

A ``Contender`` names one front end (our gateway or a router with a policy); ``running_router`` starts
a router process on a free port over the given workers and stops it after; ``stock_vllm_pd`` starts the
stock vLLM prefill and decode servers that vllm-router's own PD mode drives.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from cli.local_cluster import REPO, stop
from services.common.net import free_port

ROUTER_MODULES = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router",
                  "vllm-pd": "vllm_router.launch_router", "dynamo": "dynamo.frontend",
                  "dynamo-pd": "dynamo.frontend"}  # fmt: skip
ROUTER_PACKAGES = {"sglang": "sglang-router", "vllm": "vllm-router", "vllm-pd": "vllm-router", "dynamo": "dynamo",
                   "dynamo-pd": "dynamo"}  # fmt: skip
ROUTER_POLICIES = {"sglang": ("cache_aware", "round_robin", "power_of_two", "random"),
                   "vllm": ("cache_aware", "kv_aware", "power_of_two", "round_robin", "random"),
                   "vllm-pd": ("cache_aware", "power_of_two", "round_robin", "random"),
                   "dynamo": ("kv", "round_robin"), "dynamo-pd": ("kv", "round_robin")}  # fmt: skip
SERVER_READY_TIMEOUT_S = 300.0
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_STOP_TIMEOUT_S = 15.0
HOST = "127.0.0.1"
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"  # Dynamo runs in its own environment (make dynamo)
# Why kv_aware is degraded on a cluster whose workers publish no ZMQ KV events (--cluster-json of one started
# without [engine] zmq_kv_events): vllm-router's kv index stays empty.
KV_AWARE_NOTE = ("no KV events: the workers publish none in vLLM's ZMQ format ([engine] zmq_kv_events is off), "
                 "so vllm-router's kv index stays empty")  # fmt: skip


@dataclass(frozen=True)
class Contender:
    """One front end for the workers: our gateway (``router`` None) or a PyPI router with a policy."""

    spec: str  # "conductor", "sglang:cache_aware", ...
    router: str | None
    policy: str
    # "colocated", "disaggregated", "conditional" (our clusters), "vllm-pd" (stock vLLM servers), "dynamo" or
    # "dynamo-pd" (mockers)
    deployment: str

    @property
    def label(self) -> str:
        """Table label, e.g. ``sglang-router cache_aware``."""
        if self.router is None:
            kind = {"disaggregated": " PD", "conditional": " conditional"}.get(self.deployment, "")
            return f"conductor{kind} ({self.policy})"
        if self.router in ("dynamo", "dynamo-pd"):
            return f"dynamo{' PD' if self.router == 'dynamo-pd' else ''} {self.policy} (its mocker workers)"
        return f"{ROUTER_PACKAGES[self.router]}{' PD' if self.router == 'vllm-pd' else ''} {self.policy}"


def parse_contender(spec: str, conductor_policy: str = "kvcache_centric") -> Contender:
    """``conductor``, ``conductor:disaggregated``, ``conductor:conditional`` or ``ROUTER:POLICY``; ValueError else."""
    if spec in ("conductor", "conductor:colocated", "conductor:disaggregated", "conductor:conditional"):
        return Contender(spec, None, conductor_policy, spec.partition(":")[2] or "colocated")
    router, _, policy = spec.partition(":")
    if router not in ROUTER_MODULES or policy not in ROUTER_POLICIES[router]:
        choices = ", ".join(f"{r}:{p}" for r, ps in ROUTER_POLICIES.items() for p in ps)
        raise ValueError(
            f"unknown contender {spec!r}: use conductor, conductor:disaggregated, conductor:conditional "
            f"or one of {choices}"
        )
    return Contender(spec, router, policy, router if router in ("vllm-pd", "dynamo", "dynamo-pd") else "colocated")


def router_available(router: str) -> str | None:
    """None when the router's launcher imports here (Dynamo: in its own environment), else why not."""
    if router in ("dynamo", "dynamo-pd"):
        return None if DYNAMO_PYTHON.exists() else f"Dynamo is not installed ({DYNAMO_PYTHON} missing: run make dynamo)"
    module = ROUTER_MODULES[router]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return None if found else f"{ROUTER_PACKAGES[router]} is not installed (no module {module})"


def router_command(contender: Contender, worker_args: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """The launcher's command line. Each router gets its own Prometheus port: both default to 29000.

    ``worker_args``: ``--worker-urls URL...`` for a colocated pool, ``--prefill URL PORT --decode URL`` in PD.
    """
    assert contender.router is not None
    level = "warn" if contender.router == "sglang" else "warning"
    return [sys.executable, "-m", ROUTER_MODULES[contender.router], "--host", HOST, "--port", str(port),
            *worker_args, "--policy", contender.policy,
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", level]  # fmt: skip


def _stop(process: subprocess.Popen[bytes]) -> None:
    stop(process, ROUTER_STOP_TIMEOUT_S)


@contextmanager
def serving(command: Sequence[str], port: int, name: str, log_path: Path, timeout_s: float) -> Iterator[None]:
    """Start an HTTP server process, wait until ``GET /health`` on ``port`` answers 200, stop it after."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write((" ".join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{name} exited with {process.returncode}: " + " | ".join(tail))
            try:
                if httpx.get(f"http://{HOST}:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s ({log_path})")
            time.sleep(0.25)
        yield
    finally:
        _stop(process)


@contextmanager
def running_router(contender: Contender, worker_args: Sequence[str], log_path: Path) -> Iterator[str]:
    """Start the router (``router_command``) until healthy, yield its ``/v1`` base URL, stop it."""
    port, metrics_port = free_port(), free_port()
    command = router_command(contender, worker_args, port, metrics_port)
    with serving(command, port, contender.label, log_path, ROUTER_READY_TIMEOUT_S):
        yield f"http://{HOST}:{port}/v1"


@contextmanager
def stock_vllm_pd(args: argparse.Namespace, root: Path) -> Iterator[list[str]]:
    """One prefill and one decode stock vLLM server (``bench/compare/vllm_server.py``); yields the router's
    worker arguments ``--vllm-pd-disaggregation --kv-connector mooncake --prefill URL PORT --decode URL``."""
    ports = {role: free_port() for role in ("prefill", "decode")}
    base = [sys.executable, "-m", "bench.compare.vllm_server", "--config", args.config, "--host", HOST,
            *(a for override in args.set for a in ("--set", override))]  # fmt: skip
    logs = {role: root / f"vllm-server-{role}.log" for role in ports}
    print(f"[routers] starting stock vLLM prefill and decode servers (logs {root}) ...", file=sys.stderr, flush=True)
    with (
        serving([*base, "--role", "prefill", "--port", str(ports["prefill"])], ports["prefill"], "vLLM prefill server",
                logs["prefill"], SERVER_READY_TIMEOUT_S),
        serving([*base, "--role", "decode", "--port", str(ports["decode"])], ports["decode"], "vLLM decode server",
                logs["decode"], SERVER_READY_TIMEOUT_S),
    ):  # fmt: skip
        found = re.search(r"bootstrap_port=(\d+)", logs["prefill"].read_text(errors="replace"))
        if not found:
            raise RuntimeError(f"the vLLM prefill server printed no bootstrap port ({logs['prefill']})")
        yield ["--vllm-pd-disaggregation", "--kv-connector", "mooncake",
               "--prefill", f"http://{HOST}:{ports['prefill']}", found.group(1),
               "--decode", f"http://{HOST}:{ports['decode']}"]  # fmt: skip
