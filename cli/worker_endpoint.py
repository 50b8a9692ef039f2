"""The OpenAI API served by a colocated worker itself, as a vLLM or SGLang server does.

Composed here, at the process level (``kvconductor serve colocated``), not in ``services/worker``: it joins
three services (the worker, a Conductor, the gateway's REST shim), and no service package imports another.

Third-party OpenAI routers (the SGLang router, vLLM's router) front workers that speak HTTP. So a
colocated worker also runs the REST shim (``/health``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize``, ``/get_load``) over a Conductor of its own: the same Conductor
code, with a view that holds only this worker, served on the worker's gRPC server; it admits by the SLO as
the Conductor does unless ``[scheduler] worker_endpoint_admission`` is off. The shim runs on its own thread
and event loop; its URL is published in the worker's etcd record as ``openai_url`` (HTTPS with the worker's
certificate when the cluster runs TLS; API keys as on the gateway).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace

import uvicorn

from engine.tokenizer import load_tokenizer
from services.common.registry import InstanceEvent
from services.common.rpc import Service
from services.conductor import conductor
from services.conductor.cluster_view import ClusterView
from services.gateway.gateway import create_app, server_config
from services.worker.worker import Worker


class WorkerEndpoint:
    """A one-instance Conductor plus the REST shim in front of it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        config = worker.config
        admits = config.scheduler.reject_on_slo_violation and config.scheduler.worker_endpoint_admission
        config = replace(config, scheduler=replace(config.scheduler, reject_on_slo_violation=admits))
        self.view = ClusterView(config.engine.backend)
        # its own id: the cluster's Conductors and this one count each other's requests on this worker
        self.conductor = conductor.ConductorServicer(
            config, self.view, load_tokenizer(config.model.path), f"{worker.instance_id}-endpoint"
        )
        self._background: asyncio.Task[None] | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def services(self) -> list[Service]:
        """The local Conductor, for the worker's gRPC server."""
        return conductor.services(self.conductor)

    async def start(self, address: str) -> None:
        """Once the gRPC server is bound: know this worker, and serve the shim on a free port."""
        self.view.attach(asyncio.get_running_loop())
        record = self.worker.record(address, self.worker.metrics_address)
        self.view.on_event(InstanceEvent("put", self.worker.role, self.worker.instance_id, record))
        self._background = asyncio.create_task(self.conductor.run())
        config = self.worker.config
        # Bound here and handed to uvicorn: a port only picked here could be taken by another process before
        # uvicorn binds it, and the worker would publish an openai_url that some other server answers.
        sock = socket.socket(socket.AF_INET6 if ":" in config.cluster.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((config.cluster.host, 0))
        port = sock.getsockname()[1]
        local = replace(
            config,
            cluster=replace(config.cluster, scheduler_endpoint=address),
            gateway=replace(config.gateway, host=config.cluster.host, port=port),
        )
        # With TLS in the cluster the endpoint serves HTTPS with the worker's own certificate.
        cert, key, _ = config.cluster.tls_files(self.worker.role)
        app = create_app(local, discover=False)
        self._server = uvicorn.Server(server_config(app, config.cluster.host, port, cert, key, "warning"))
        # On a thread of its own: uvicorn installs signal handlers only on the main thread.
        self._thread = threading.Thread(target=self._server.run, args=([sock],), name="openai-http", daemon=True)
        self._thread.start()
        self.worker.openai_url = f"{'https' if cert else 'http'}://{config.cluster.host}:{port}"

    def stop(self) -> None:
        """Stop the shim."""
        if self._background is not None:
            self._background.cancel()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
