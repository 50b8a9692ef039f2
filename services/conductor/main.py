"""The Conductor process: serve ``Generate`` at ``[cluster] scheduler_endpoint``, registered in etcd."""

from __future__ import annotations

import asyncio

from engine.tokenizer import load_tokenizer
from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.rpc import serve
from services.conductor import conductor
from services.conductor.cluster_view import ClusterView


async def run(config: Config, instance_id: str) -> None:
    """Serve Generate at ``[cluster] scheduler_endpoint``."""
    registry = cluster_registry(config)
    view = ClusterView(config.engine.backend)
    view.attach(asyncio.get_running_loop())
    registry.watch(view.on_event)
    servicer = conductor.ConductorServicer(config, view, load_tokenizer(config.model.path), instance_id)
    host, _, port = config.cluster.scheduler_endpoint.rpartition(":")
    watch = asyncio.create_task(view.watch_suspects())
    background = asyncio.create_task(servicer.run())  # kvmeta's index; the other replicas' load
    await serve(
        conductor.services(servicer), host, int(port), registry=registry, role="conductor",
        instance_id=instance_id, metrics_port=config.telemetry.metrics_port,
        live=view.can_serve,  # health (and the gateway's /health) is SERVING once a request could be served
        api_keys=config.gateway.api_keys, public=True,  # the public API takes the REST shim's keys
    )  # fmt: skip
    watch.cancel()
    background.cancel()
