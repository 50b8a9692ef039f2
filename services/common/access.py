"""Who may call which RPC: the role named in the caller's certificate, checked on every call under mutual TLS.

Every process's certificate carries its role as a SPIFFE ID, a URI SAN ``spiffe://kvconductor/ROLE``
(``deploy/k8s/base/issue-cert.sh`` issues them; ``[cluster] tls_cert_file`` may hold ``{role}`` so that
one config names a file per role). A server with mutual TLS answers a call only if :data:`CALLERS` lets
the caller's role call that method; anything else gets PERMISSION_DENIED naming the role and who may call,
before the request is handled. A method missing from the table is refused: new RPCs are closed until listed.

Without TLS there is nothing to check (the trust model allows plaintext on loopback only, or with
``[cluster] insecure_network``); the Conductor's public port, with API keys, asks for no certificate and
checks the key instead (services/common/api_keys.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

SPIFFE_PREFIX = "spiffe://kvconductor/"
ROLES = ("gateway", "conductor", "kvmeta", "store", "prefill", "decode", "colocated", "admin")
ANY_CERTIFICATE = frozenset({"*"})  # any certificate the cluster's CA signed, with a role or without
# A colocated worker runs a Conductor of its own for its OpenAI endpoint (cli/worker_endpoint.py).
CONDUCTORS = frozenset({"conductor", "colocated"})
# Method (or service prefix) -> the roles that may call it. "admin" is the command line (status, explain).
CALLERS: dict[str, frozenset[str]] = {
    "/kvconductor.v1.Conductor/": frozenset({"gateway", "admin"}) | CONDUCTORS,
    "/kvconductor.v1.Prefill/Prefill": CONDUCTORS,
    # A prefill worker copying a prefix pins, reads and unpins another prefill worker's blocks
    # (services/worker/kv/copy.py).
    "/kvconductor.v1.Prefill/ExportBlocks": frozenset({"prefill"}),
    "/kvconductor.v1.Prefill/ReleaseBlocks": frozenset({"prefill"}),
    "/kvconductor.v1.Decode/": CONDUCTORS,
    "/kvconductor.v1.Colocated/": CONDUCTORS,
    "/kvconductor.v1.Worker/": CONDUCTORS | {"admin"},
    "/kvconductor.v1.KvMeta/PublishEvents": frozenset({"prefill", "colocated"}),  # decode caches no prefix
    "/kvconductor.v1.KvMeta/Follow": CONDUCTORS | {"admin"},
    "/kvconductor.v1.KvMeta/MatchPrefix": CONDUCTORS | {"admin"},
    "/grpc.health.v1.Health/": ANY_CERTIFICATE,
    "/grpc.reflection.v1alpha.ServerReflection/": ANY_CERTIFICATE,
    "/grpc.reflection.v1.ServerReflection/": ANY_CERTIFICATE,
}


def spiffe_id(role: str) -> str:
    """The URI SAN that names ``role`` in a certificate."""
    return SPIFFE_PREFIX + role


def allowed(method: str) -> frozenset[str]:
    """The roles that may call ``method`` (``/package.Service/Method``); none for a method not listed."""
    exact = CALLERS.get(method)
    if exact is not None:
        return exact
    service = method[: method.rfind("/") + 1]
    return CALLERS.get(service, frozenset())


def caller_role(context: grpc.aio.ServicerContext) -> str:
    """The role in the caller's certificate; "" when it names none."""
    for value in context.auth_context().get("peer_spiffe_id", ()):
        uri = str(value.decode(errors="replace"))
        if uri.startswith(SPIFFE_PREFIX) and uri[len(SPIFFE_PREFIX) :] in ROLES:
            return uri[len(SPIFFE_PREFIX) :]
    return ""


class RoleCheck(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for a caller whose certificate's role may not call the method."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the handler so that it checks the caller's role before anything else runs."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        roles = allowed(method)
        if roles is ANY_CERTIFICATE:
            return handler  # the TLS handshake checked the certificate

        async def check(context: grpc.aio.ServicerContext) -> None:
            role = caller_role(context)
            if role not in roles:
                who = f"a caller with role {role!r}" if role else "a certificate without a kvconductor role"
                may = ", ".join(sorted(roles)) or "nobody"
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: {who} may not call it (may: {may}; a role is the URI SAN {SPIFFE_PREFIX}ROLE)",
                )

        return _checked_first(handler, check)


def _checked_first(
    handler: grpc.RpcMethodHandler, check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
) -> grpc.RpcMethodHandler:
    """``handler`` with ``check(context)`` awaited before its behaviour, for each of the four call types."""
    serialization = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **serialization)
    if handler.stream_unary is not None:
        stream_in = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await stream_in(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **serialization)
    streaming = handler.unary_stream or handler.stream_stream

    async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await check(context)
        async for item in streaming(request, context):
            yield item

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streamed, **serialization)
    return grpc.stream_stream_rpc_method_handler(streamed, **serialization)
