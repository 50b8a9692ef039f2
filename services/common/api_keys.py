"""API keys on the public gRPC API: the same bearer keys as the REST shim (``[gateway] api_keys``).

With keys configured, every call to a ``kvconductor.v1.Conductor`` method (the Conductor's port, and the
Conductor a colocated worker runs for its OpenAI endpoint) carries ``authorization: Bearer KEY`` metadata
or gets UNAUTHENTICATED, before its request is parsed; health and reflection stay open (load balancers and
Kubernetes probe them). Keys, not certificates, are then the Conductor's credential, so with TLS its port
asks for no client certificate (a user's client has none). Every other gRPC port keeps mutual TLS and the
role check of services/common/access.py.

A process calls out with one key: ``KVCONDUCTOR_API_KEY`` when set, else the first configured key.
"""

from __future__ import annotations

import collections
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.common.config import Config

KEYED_METHODS = ("/kvconductor.v1.Conductor/",)  # the public API: a key is needed where keys are configured
ENV_KEY = "KVCONDUCTOR_API_KEY"

_key = ""  # the key this process sends; "" = none


def use_api_key(config: Config) -> None:
    """Set the key this process sends on its calls (``KVCONDUCTOR_API_KEY``, else the first configured)."""
    global _key
    _key = os.environ.get(ENV_KEY) or next(iter(config.gateway.api_keys), "")


def auth_metadata(key: str | None = None) -> list[tuple[str, str]]:
    """The metadata that carries ``key`` (None: this process's key); none without one."""
    key = _key if key is None else key
    return [("authorization", f"Bearer {key}")] if key else []


class WithKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Blocking channels: adds a key's metadata to unary and server-streaming calls."""

    def __init__(self, key: str | None = None) -> None:
        self.metadata = auth_metadata(key)

    def _details(self, details: Any) -> Any:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), *self.metadata],
                            details.credentials, details.wait_for_ready, details.compression)  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        """Unary calls."""
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        """Server-streaming calls."""
        return continuation(self._details(client_call_details), request)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]
    ),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails with metadata of our choosing."""


class ApiKeyCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call to the public API without one of ``keys``."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = [k.encode() for k in keys]

    def valid(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether ``metadata`` carries one of the keys (compared in constant time per key)."""
        given = next((v for k, v in metadata or () if k == "authorization"), "")
        token = (given.decode() if isinstance(given, bytes) else given).removeprefix("Bearer ").strip().encode()
        return any(hmac.compare_digest(token, key) for key in self.keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Pass a call with a valid key, or outside the public API, on; answer any other with UNAUTHENTICATED."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        keyed = method.startswith(KEYED_METHODS)
        if handler is None or not keyed or self.valid(handler_call_details.invocation_metadata):
            return handler
        return _refusal(handler, method)


def _refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED."""
    why = f"{method}: invalid or missing API key (send metadata 'authorization: Bearer KEY')"

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # never reached: a streaming handler is an async generator

    # The request is never parsed: a caller without a key learns nothing, not even what its bytes were.
    serialization = {"request_deserializer": lambda _: None, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **serialization)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serialization)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **serialization)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **serialization)
