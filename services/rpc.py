"""One way to run every gRPC service: errors mapped to status codes, health, reflection, etcd, shutdown.

Lifecycle of :func:`serve`::

    bind (port 0 = any) -> health SERVING -> register in etcd under a lease -> ... SIGTERM/SIGINT ->
    health NOT_SERVING -> revoke the lease -> server.stop(grace) -> on_stop()

Handlers raise :class:`RpcError` (or ``ValueError`` for bad input) and never build status codes by hand;
anything else becomes INTERNAL with a short message, logged here with its stack trace, never sent.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from services.registry import Registry

log = logging.getLogger(__name__)


class RpcError(Exception):
    """An error with the gRPC status code the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, RpcError):
        return error.code, error.message
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: keep its code, say where it came from.
        return error.code(), f"upstream: {error.details()}"
    log.exception("unhandled error in a handler")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping handlers to status codes (unary and server-streaming)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the handler's behaviour."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - the boundary that turns errors into status codes
            await context.abort(*_status_of(e))

    return wrapped


def _wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001
            await context.abort(*_status_of(e))

    return wrapped


@dataclass
class Service:
    """A servicer and how to add it to a server."""

    name: str  # full service name, e.g. "kvconductor.v1.Prefill"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]


async def serve(
    services: Iterable[Service],
    host: str,
    port: int,
    *,
    registry: Registry | None = None,
    role: str = "",
    instance_id: str = "",
    record: Callable[[str], dict[str, Any]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
) -> None:
    """Serve until SIGTERM/SIGINT; ``record(address)`` builds the etcd record once the port is known."""
    services = list(services)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.name for s in services] + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    address = f"{host}:{bound}"
    await server.start()
    try:
        for name in ["", *names]:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if registry is not None and record is not None:
            await asyncio.to_thread(registry.register, role, instance_id, record(address))
        log.info("%s %s serving on %s", role or "service", instance_id, address)
        await _wait_for_signal()
        log.info("%s %s shutting down", role or "service", instance_id)
        for name in ["", *names]:
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if registry is not None:
            await asyncio.to_thread(registry.close)
    finally:
        await server.stop(grace_s)
        if on_stop is not None:
            await on_stop()


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
