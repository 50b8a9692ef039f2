"""A worker process (prefill, decode or colocated): load the engine, profile it, serve, registered in etcd.

Exit status 0 after SIGTERM/SIGINT, ``EXIT_ENGINE_DIED`` when the engine thread died (the worker left
the cluster at once; its requests resume elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from typing import Protocol

from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.rpc import Service, serve
from services.worker import colocated, decode, prefill
from services.worker.worker import Worker, build_worker

log = logging.getLogger(__name__)
EXIT_ENGINE_DIED = 3  # a worker whose engine thread died exits with this status
FAULT_INJECTION_ENV = "KVCONDUCTOR_FAULT_INJECTION"  # "1" enables the test-only fault signals on workers


class Endpoint(Protocol):
    """More services a worker process serves beside its engine's.

    A colocated worker's OpenAI endpoint (``cli/worker_endpoint.py``), composed by the process's launcher.
    """

    def services(self) -> list[Service]:
        """The gRPC services for the worker's server."""
        ...

    async def start(self, address: str) -> None:
        """Once the worker's gRPC server is bound at ``address``."""
        ...

    def stop(self) -> None:
        """When the worker stops."""
        ...


async def run(
    config: Config, role: str, instance_id: str, endpoint_of: Callable[[Worker], Endpoint] | None = None
) -> int:
    """Serve a prefill, decode or colocated engine worker; the exit status (non-zero if its engine died).

    ``endpoint_of``: a colocated worker's further services, built once the worker is.
    """
    registry = cluster_registry(config)
    worker = await build_worker(config, role, instance_id, registry)
    worker.engine.start()
    background = [asyncio.create_task(worker.refine_cost_models())]
    endpoint: Endpoint | None = None  # colocated workers also speak the OpenAI API themselves
    if role != "decode":  # decode workers do not cache prefixes
        background.append(asyncio.create_task(worker.heartbeat_kv_events()))
    if role == "prefill":
        services, prefiller = prefill.services(worker)
        background.append(asyncio.create_task(prefiller.exports.expire()))
    else:  # a colocated worker decodes requests prefilled elsewhere too (conditional disaggregation)
        services, decoder = decode.services(worker) if role == "decode" else colocated.services(worker)
        background.append(asyncio.create_task(decoder.expire_reservations()))
        if role == "colocated" and endpoint_of is not None:
            endpoint = endpoint_of(worker)
            services += endpoint.services()

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
        services, config.cluster.host, config.cluster.grpc_port, registry=registry, role=role, instance_id=instance_id,
        record=worker.record, on_stop=on_stop, metrics_port=config.telemetry.metrics_port,
        on_bound=endpoint.start if endpoint is not None else None, grace_s=config.cluster.drain_grace_s,
        live=lambda: worker.engine.heartbeat()[1] < heartbeat_timeout, fatal=worker.engine.died,
        api_keys=config.gateway.api_keys if endpoint is not None else (),  # its own Conductor's public API
    )  # fmt: skip
    return 0 if graceful else EXIT_ENGINE_DIED


def _install_fault_signals(worker: Worker) -> None:
    """Test-only fault hooks: SIGUSR1 makes the engine thread raise, SIGUSR2 freezes it (again: thaws it)."""
    loop = asyncio.get_running_loop()
    frozen = False

    def toggle_freeze() -> None:
        nonlocal frozen
        frozen = not frozen
        worker.engine.inject_fault("freeze" if frozen else "thaw")

    loop.add_signal_handler(signal.SIGUSR1, worker.engine.inject_fault, "raise")
    loop.add_signal_handler(signal.SIGUSR2, toggle_freeze)
    log.warning(
        "fault injection is on (%s=1): SIGUSR1 kills the engine thread, SIGUSR2 freezes it", FAULT_INJECTION_ENV
    )
