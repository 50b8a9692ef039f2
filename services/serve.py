"""``kvconductor serve ROLE``: one process of the cluster (kvmeta, conductor, prefill, decode, colocated, gateway).

Every gRPC role registers in etcd once it serves; the gateway finds the Conductor at
``[cluster] scheduler_endpoint``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING

from services.config import Config
from services.registry import EtcdAuth, InstanceEvent, Registry
from services.rpc import serve
from services.telemetry import setup_tracing

if TYPE_CHECKING:  # kvmeta, the Conductor and the gateway must not import torch
    from services.worker import Worker

log = logging.getLogger(__name__)
EXIT_ENGINE_DIED = 3  # a worker whose engine thread died exits with this status
FAULT_INJECTION_ENV = "KVCONDUCTOR_FAULT_INJECTION"  # "1" enables the test-only fault signals on workers
ROLES = ("kvmeta", "conductor", "prefill", "decode", "colocated", "gateway")


def etcd_auth(config: Config) -> EtcdAuth | None:
    """The etcd client's TLS files and credentials from ``[cluster]`` (None when there are none)."""
    c = config.cluster
    password = os.environ.get("KVCONDUCTOR_ETCD_PASSWORD")
    if not (c.etcd_ca_file or c.etcd_cert_file or c.etcd_user):
        return None
    return EtcdAuth(
        c.etcd_ca_file or None, c.etcd_cert_file or None, c.etcd_key_file or None, c.etcd_user or None, password
    )


def _registry(config: Config) -> Registry:
    if not config.cluster.etcd_endpoints:
        raise ValueError("[cluster] etcd_endpoints is empty: `serve` needs a running etcd (`up` starts one)")
    return Registry(
        config.cluster.etcd_endpoints, config.cluster.name, ttl=config.cluster.lease_ttl_s, auth=etcd_auth(config)
    )


async def run_kvmeta(config: Config, instance_id: str) -> None:
    """Serve the global KV index; drop an instance's blocks when its lease goes."""
    from services import kvmeta

    registry = _registry(config)
    servicer = kvmeta.KvMetaServicer()
    loop = asyncio.get_running_loop()

    def on_event(event: InstanceEvent) -> None:
        loop.call_soon_threadsafe(servicer.on_instance_event, event)

    registry.watch(on_event)
    await serve(
        kvmeta.services(servicer), config.cluster.host, 0, registry=registry, role="kvmeta",
        instance_id=instance_id, metrics_port=config.telemetry.metrics_port,
        record=lambda address, metrics: {"role": "kvmeta", "address": address, "metrics_address": metrics},
    )  # fmt: skip


async def run_conductor(config: Config, instance_id: str) -> None:
    """Serve Generate at ``[cluster] scheduler_endpoint``."""
    from engine.tokenizer import load_tokenizer
    from services import conductor
    from services.cluster_view import ClusterView

    registry = _registry(config)
    view = ClusterView()
    view.attach(asyncio.get_running_loop())
    registry.watch(view.on_event)
    servicer = conductor.ConductorServicer(config, view, load_tokenizer(config.model.path))
    host, _, port = config.cluster.scheduler_endpoint.rpartition(":")
    watch = asyncio.create_task(view.watch_suspects())
    await serve(
        conductor.services(servicer), host, int(port), registry=registry, role="conductor",
        instance_id=instance_id, metrics_port=config.telemetry.metrics_port,
        record=lambda address, metrics: {"role": "conductor", "address": address, "metrics_address": metrics},
    )  # fmt: skip
    watch.cancel()


async def run_worker(config: Config, role: str, instance_id: str) -> int:
    """Serve a prefill, decode or colocated engine worker; the exit status (non-zero if its engine died)."""
    from services import colocated, decode, prefill
    from services.worker import build_worker
    from services.worker_http import WorkerEndpoint

    registry = _registry(config)
    worker = build_worker(config, role, instance_id, registry)
    worker.loop.start()
    background = [asyncio.create_task(worker.refine_cost_models())]
    endpoint: WorkerEndpoint | None = None  # colocated workers also speak the OpenAI API themselves
    if role != "decode":  # decode workers do not cache prefixes
        background.append(asyncio.create_task(worker.heartbeat_kv_events()))
    if role == "prefill":
        services, prefiller = prefill.services(worker)
        background.append(asyncio.create_task(prefiller.exports.expire()))
    elif role == "decode":
        services, decoder = decode.services(worker)
        background.append(asyncio.create_task(decoder.expire_reservations()))
    else:
        endpoint = WorkerEndpoint(worker)
        services = [*colocated.services(worker), *endpoint.services()]

    async def on_stop() -> None:
        for task in background:
            task.cancel()
        if endpoint is not None:
            endpoint.stop()
        await worker.close()

    if os.environ.get(FAULT_INJECTION_ENV) == "1":
        _install_fault_signals(worker)
    heartbeat_timeout = config.cluster.engine_heartbeat_timeout_s
    graceful = await serve(
        services, config.cluster.host, 0, registry=registry, role=role, instance_id=instance_id,
        record=worker.record, on_stop=on_stop, metrics_port=config.telemetry.metrics_port,
        on_bound=endpoint.start if endpoint is not None else None, grace_s=config.cluster.drain_grace_s,
        live=lambda: worker.loop.heartbeat_age() < heartbeat_timeout, fatal=worker.loop.died,
    )  # fmt: skip
    return 0 if graceful else EXIT_ENGINE_DIED


def _install_fault_signals(worker: Worker) -> None:
    """Test-only fault hooks: SIGUSR1 makes the engine thread raise, SIGUSR2 freezes it (again: thaws it)."""
    loop = asyncio.get_running_loop()
    frozen = False

    def toggle_freeze() -> None:
        nonlocal frozen
        frozen = not frozen
        worker.loop.inject_fault("freeze" if frozen else "thaw")

    loop.add_signal_handler(signal.SIGUSR1, worker.loop.inject_fault, "raise")
    loop.add_signal_handler(signal.SIGUSR2, toggle_freeze)
    log.warning(
        "fault injection is on (%s=1): SIGUSR1 kills the engine thread, SIGUSR2 freezes it", FAULT_INJECTION_ENV
    )


def run(config: Config, role: str, instance_id: str) -> int:
    """Run one role until SIGTERM/SIGINT; the process's exit status."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of: {', '.join(ROLES)})")
    provider = setup_tracing(config.telemetry, role, instance_id)
    try:
        if role == "gateway":
            from services.gateway import run_gateway

            run_gateway(config)
        elif role == "kvmeta":
            asyncio.run(run_kvmeta(config, instance_id))
        elif role == "conductor":
            asyncio.run(run_conductor(config, instance_id))
        else:
            return asyncio.run(run_worker(config, role, instance_id))
    finally:
        provider.shutdown()  # flushes the spans still buffered
    return 0
