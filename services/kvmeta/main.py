"""The kvmeta process: serve the global KV index, registered in etcd."""

from __future__ import annotations

from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.rpc import serve
from services.kvmeta.kvmeta import KvMetaServicer, services


async def run(config: Config, instance_id: str) -> None:
    """Serve the global KV index; index only registered instances, drop an instance's blocks when its lease goes."""
    registry = cluster_registry(config)
    servicer = KvMetaServicer(store_grace_s=config.store.index_grace_s)
    servicer.follow(registry)
    await serve(
        services(servicer), config.cluster.host, config.cluster.grpc_port, registry=registry, role="kvmeta",
        instance_id=instance_id, metrics_port=config.telemetry.metrics_port,
    )  # fmt: skip
