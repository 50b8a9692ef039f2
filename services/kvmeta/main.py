"""The kvmeta process: serve the global KV index, registered in etcd."""

from __future__ import annotations

import asyncio

from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.registry import InstanceEvent
from services.common.rpc import serve
from services.kvmeta.kvmeta import KvMetaServicer, services


async def run(config: Config, instance_id: str) -> None:
    """Serve the global KV index; drop an instance's blocks when its lease goes."""
    registry = cluster_registry(config)
    servicer = KvMetaServicer()
    loop = asyncio.get_running_loop()

    def on_event(event: InstanceEvent) -> None:
        loop.call_soon_threadsafe(servicer.on_instance_event, event)

    registry.watch(on_event)
    await serve(
        services(servicer), config.cluster.host, config.cluster.grpc_port, registry=registry, role="kvmeta",
        instance_id=instance_id, metrics_port=config.telemetry.metrics_port,
    )  # fmt: skip
