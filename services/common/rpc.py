"""One way to run every gRPC service and call it: errors, tracing, health, reflection, metrics, etcd, shutdown.

Lifecycle of :func:`serve`::

    bind (port 0 = any) -> /metrics -> health SERVING -> register in etcd under a lease -> ...
    SIGTERM/SIGINT -> health NOT_SERVING -> revoke the lease -> server.stop(grace) -> on_stop()
    fatal error (a worker's engine died) -> the same at once, with a 1 s grace

While serving, health follows the process's liveness check (a worker: its engine loop's heartbeat).

Handlers raise :class:`RpcError` (or ``ValueError`` for bad input) and never build status codes by hand;
anything else becomes INTERNAL with a short message, logged here with its stack trace, never sent. Every
call runs in a server span continued from the caller's trace context; channels made by :func:`channel`
send the current context with every call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, StatusCode, get_current_span, use_span
from opentelemetry.trace import Status as SpanStatus

from services.common.access import RoleCheck
from services.common.api_keys import ApiKeyCheck, WithKey, auth_metadata
from services.common.instance_record import InstanceRecord
from services.common.metrics import serve_metrics
from services.common.registry import Registry
from services.common.telemetry import extract_context, inject_metadata, tracer

log = logging.getLogger(__name__)
KV_TRANSFER_FAILED = "KV transfer failed"  # prefix of a prefill worker's error when its write into decode fails
TRACE_ROOTS = frozenset({"kvconductor.v1.Conductor/Generate"})  # methods that start a trace if none came


class RpcError(Exception):
    """An error with the gRPC status code the caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata  # trailing metadata for the caller (an SLO rejection's kind and retry-after)


Status = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


def _status_of(error: BaseException) -> Status:
    if isinstance(error, RpcError):
        return error.code, error.message, error.metadata
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error), ()
    if isinstance(error, grpc.aio.AioRpcError):
        # A downstream call failed: keep its code, say where it came from.
        return error.code(), f"upstream: {error.details()}", ()
    log.exception("unhandled error in a handler")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}", ()


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Runs handlers in a server span, maps exceptions escaping them to status codes, refuses malformed bytes.

    A request whose bytes do not parse gets INVALID_ARGUMENT naming the message type and what was wrong
    (grpc would answer UNKNOWN), on every method of every service, streamed requests included.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the handler's behaviour."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.lstrip("/")
        serialization = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, method), **serialization)
        if handler.unary_stream is not None:
            # A handler that streams with context.write (grpc's health Watch) is a coroutine, not a generator.
            wrap = _wrap_unary if inspect.iscoroutinefunction(handler.unary_stream) else _wrap_stream
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, method), **serialization)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_parsed_stream_unary(handler.stream_unary), **serialization)
        return grpc.stream_stream_rpc_method_handler(_parsed_stream_stream(handler.stream_stream), **serialization)


@dataclass(frozen=True)
class _Malformed:
    """What a request's bytes parsed to when they were not a valid message."""

    why: str


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize``, answering :class:`_Malformed` instead of raising on bytes that do not parse."""
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Malformed(f"malformed request: {e}")

    return parse


async def _refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """A request stream that ends the call with INVALID_ARGUMENT at a malformed message."""
    async for request in requests:
        await _refuse_malformed(request, context)
        yield request


def _parsed_stream_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_checked(requests, context), context)

    return wrapped


def _parsed_stream_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    # An async generator function, so that grpc.aio runs it as one (a plain function returning one is not).
    async def wrapped(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in behavior(_checked(requests, context), context):
            yield item

    return wrapped


def _server_span(method: str, context: grpc.aio.ServicerContext) -> Span:
    """A server span continuing the caller's trace; only the public API starts new traces.

    Background calls (KV-event heartbeats, load polls, health) arrive without a trace context and are
    not traced, so the trace backend holds requests, not housekeeping.
    """
    parent = extract_context(context.invocation_metadata() or ())
    if method not in TRACE_ROOTS and not get_current_span(parent).get_span_context().is_valid:
        return INVALID_SPAN
    return tracer.start_span(method, context=parent, kind=SpanKind.SERVER, record_exception=False)


def _fail(span: Span, error: BaseException) -> Status:
    code, message, metadata = _status_of(error)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_status(SpanStatus(StatusCode.ERROR, message))
    return code, message, metadata


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse_malformed(request, context)
        span = _server_span(method, context)
        try:
            with use_span(span, end_on_exit=False):
                return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - the boundary that turns errors into status codes
            await context.abort(*_fail(span, e))
        finally:
            span.end()

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a server-streaming handler.

    The span is made current around each step of the handler, never across a ``yield``: gRPC may close
    the stream from another task, where a context attached before the yield could not be detached.
    """

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse_malformed(request, context)
        span = _server_span(method, context)
        items = behavior(request, context)
        try:
            while True:
                try:  # the stream's end (StopAsyncIteration) is no error: only real ones are recorded, below
                    with use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                        item = await anext(items)
                except StopAsyncIteration:
                    return
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001
            span.record_exception(e)
            await context.abort(*_fail(span, e))
        finally:
            with use_span(span, end_on_exit=False):
                await items.aclose()
            span.end()

    return wrapped


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = [*(details.metadata or ()), *inject_metadata(), *auth_metadata()]
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


# Two classes: grpc.aio files an interceptor under the first call type it implements only.
class _UnaryTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the current trace context (and this process's API key) to unary calls."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        """Unary calls."""
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamTraceContext(grpc.aio.UnaryStreamClientInterceptor):
    """Adds the current trace context to server-streaming calls."""

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        """Server-streaming calls."""
        return await continuation(_with_trace_context(client_call_details), request)


@dataclass(frozen=True)
class Tls:
    """TLS for gRPC between the services: PEM certificate, key and the CA that signed the peers' certificates."""

    cert: bytes
    key: bytes
    ca: bytes
    server_name: str = ""  # checked in every server's certificate instead of the address dialled ("" = the address)
    cert_file: str = ""  # where cert and key came from (Python's ssl loads a certificate chain only from files)
    key_file: str = ""

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, ca_file: str, server_name: str = "") -> Tls | None:
        """None when no certificate is configured (plaintext)."""
        if not cert_file:
            return None
        cert, key, ca = (Path(f).read_bytes() for f in (cert_file, key_file, ca_file))
        return cls(cert, key, ca, server_name, cert_file, key_file)

    def http_server_context(self) -> ssl.SSLContext:
        """HTTPS for the metrics port: our certificate; a client's is asked for, checked against the CA if sent."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.load_verify_locations(cadata=self.ca.decode())
        context.verify_mode = ssl.CERT_OPTIONAL
        return context

    @property
    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options for the server name, if one is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def server_credentials(self, mutual: bool = True) -> grpc.ServerCredentials:
        """Serve with our certificate; ``mutual``: require clients to present one the CA signed."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca if mutual else None, require_client_auth=mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify servers against the CA and present our certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


# The process's TLS settings, set once at start-up by `use_tls` from [cluster] tls_*; None = plaintext. Every
# server and channel of the process follows them, so a cluster is all TLS or all plaintext.
_tls: Tls | None = None


def use_tls(tls: Tls | None) -> None:
    """Set this process's TLS settings (before serving or connecting)."""
    global _tls
    _tls = tls


# HTTP/2 pings on idle and busy connections: a peer cut off mid-stream (a dead link, not a dead process) is
# noticed within keepalive_time + keepalive_timeout instead of when TCP gives up, minutes later.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def channel(address: str) -> grpc.aio.Channel:
    """A channel to a kvconductor service that propagates the trace context (TLS when configured)."""
    interceptors = [_UnaryTraceContext(), _StreamTraceContext()]
    if _tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, _tls.channel_credentials(), options=CHANNEL_OPTIONS + _tls.channel_options, interceptors=interceptors
    )


def sync_channel(address: str, api_key: str | None = None) -> grpc.Channel:
    """A blocking channel (command-line tools), TLS when configured, sending ``api_key`` (None: the process's)."""
    plain = (
        grpc.insecure_channel(address)
        if _tls is None
        else grpc.secure_channel(address, _tls.channel_credentials(), options=_tls.channel_options)
    )
    return grpc.intercept_channel(plain, WithKey(api_key))


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
    record: Callable[[str, str], InstanceRecord] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    metrics_port: int | None = 0,
    on_bound: Callable[[str], Awaitable[None]] | None = None,
    live: Callable[[], bool] | None = None,
    fatal: asyncio.Future[Any] | None = None,
    api_keys: Sequence[str] = (),
    public: bool = False,
) -> bool:
    """Serve until SIGTERM/SIGINT or ``fatal`` resolves, registered in ``registry`` (when given).

    With ``api_keys`` every call to the public API (the Conductor service) needs one of them
    (services/common/api_keys.py). With TLS every port asks for a client certificate and checks the role it
    names (services/common/access.py), except a ``public`` port with keys: the key is its credential.

    The etcd record is ``record(address, metrics_address)``, by default the plain ``InstanceRecord``.

    ``/metrics`` and ``/health`` are served on ``metrics_port`` (0 = any free; None = not at all), over HTTPS
    with TLS, where ``/metrics`` needs a client certificate the CA signed (``/health`` is open, for probes).
    ``on_bound(address)`` runs once the server listens, before the instance registers. ``live()`` is polled
    and drives the health status (SERVING while it holds). When ``fatal`` resolves (the engine died) the process leaves
    at once: NOT_SERVING, lease revoked, calls in flight get a short grace to end with their status.
    Returns False after a fatal stop, True after a signal.
    """
    services = list(services)
    mutual = _tls is not None and not (public and api_keys)
    # Outermost first: the caller's role, then malformed bytes and errors, then the key.
    interceptors: list[grpc.aio.ServerInterceptor] = [RoleCheck()] if mutual else []
    interceptors.append(ErrorInterceptor())
    if api_keys:
        interceptors.append(ApiKeyCheck(api_keys))
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.name for s in services] + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    target = f"{host}:{port}"
    bound = (
        server.add_insecure_port(target)
        if _tls is None
        else server.add_secure_port(target, _tls.server_credentials(mutual=mutual))
    )
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    address = f"{host}:{bound}"
    await server.start()
    status = _HealthStatus(health, ["", *names])
    watch = asyncio.ensure_future(status.follow(live)) if live is not None else None
    graceful = True
    try:
        await status.set(live() if live is not None else True)
        serving = lambda: status.serving is True  # noqa: E731 - read from the metrics thread
        tls = _tls.http_server_context() if _tls is not None else None
        metrics_address = serve_metrics(host, metrics_port, serving, tls) if metrics_port is not None else ""
        if on_bound is not None:
            await on_bound(address)
        if registry is not None:
            make = record or (lambda a, m: InstanceRecord(role, instance_id, a, m))
            await asyncio.to_thread(registry.register, make(address, metrics_address))
        log.info("%s %s serving on %s", role or "service", instance_id, address)
        graceful = await _wait_for_stop(fatal)
        if graceful:
            log.info("%s %s shutting down", role or "service", instance_id)
        else:
            log.critical("%s %s: fatal error, leaving the cluster now", role or "service", instance_id)
            grace_s = min(grace_s, FATAL_GRACE_S)
        if watch is not None:
            watch.cancel()
        await status.set(False)
        if registry is not None:
            await asyncio.to_thread(registry.close)
    finally:
        await server.stop(grace_s)
        if on_stop is not None:
            await on_stop()
    return graceful


FATAL_GRACE_S = 1.0  # after a fatal error, calls in flight get this long to end with their own status
LIVENESS_POLL_S = 0.5


class _HealthStatus:
    """The health status of every service of a server, switched together."""

    def __init__(self, health: health_aio.HealthServicer, names: list[str]) -> None:
        self.health = health
        self.names = names
        self.serving: bool | None = None

    async def set(self, serving: bool) -> None:
        if serving == self.serving:
            return
        self.serving = serving
        value = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.health.set(name, value)

    async def follow(self, live: Callable[[], bool]) -> None:
        """Poll ``live()`` for as long as the server runs."""
        while True:
            await asyncio.sleep(LIVENESS_POLL_S)
            serving = live()
            if serving != self.serving:
                log.warning("health: %s", "SERVING again" if serving else "NOT_SERVING (liveness check failed)")
            await self.set(serving)


async def _wait_for_stop(fatal: asyncio.Future[Any] | None) -> bool:
    """Wait for SIGTERM/SIGINT (True) or for ``fatal`` to resolve (False)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
    if fatal is not None:
        waits.append(fatal)
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    waits[0].cancel()
    return waits[0] in done
