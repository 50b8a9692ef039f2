"""``kvconductor serve ROLE``: one process of the cluster (kvmeta, store, conductor, a worker, gateway).

Each role's process lives in its folder (``services/<role>/main.py``; prefill, decode and colocated are
``services/worker``; a colocated worker's OpenAI endpoint is composed here, ``cli/worker_endpoint.py``). Every
gRPC role registers in etcd once it serves; the gateway finds the Conductor at ``[cluster]
scheduler_endpoint``. Roles are imported lazily: kvmeta, the Conductor and the gateway never import torch; the
store service runs the Mooncake Store's master (``[store]``).
"""

from __future__ import annotations

import asyncio

from services.common.config import Config
from services.common.telemetry import setup_tracing

ROLES = ("kvmeta", "store", "conductor", "prefill", "decode", "colocated", "gateway")


def run(config: Config, role: str, instance_id: str) -> int:
    """Run one role until SIGTERM/SIGINT; the process's exit status."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of: {', '.join(ROLES)})")
    provider = setup_tracing(config.telemetry, role, instance_id)
    try:
        if role == "gateway":
            from services.gateway.gateway import run_gateway

            run_gateway(config)
        elif role == "kvmeta":
            from services.kvmeta.main import run as run_kvmeta

            asyncio.run(run_kvmeta(config, instance_id))
        elif role == "store":
            from services.store.main import run as run_store

            asyncio.run(run_store(config, instance_id))
        elif role == "conductor":
            from services.conductor.main import run as run_conductor

            asyncio.run(run_conductor(config, instance_id))
        else:
            from services.worker.main import run as run_worker

            if role != "colocated":
                return asyncio.run(run_worker(config, role, instance_id))
            from cli.worker_endpoint import WorkerEndpoint  # it also serves the OpenAI API, over a Conductor

            return asyncio.run(run_worker(config, role, instance_id, WorkerEndpoint))
    finally:
        provider.shutdown()  # flushes the spans still buffered
    return 0
