"""grpc's health Watch through the interceptors every server runs: it streams each status change.

The health servicer's Watch streams with ``context.write`` (a coroutine, not an async generator); wrapped as a
generator it failed with INTERNAL (TypeError) on every port, which tests/e2e/test_netns_trust.py found.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.common.api_keys import ApiKeyCheck
from services.common.rpc import ErrorInterceptor

pytestmark = pytest.mark.asyncio(loop_scope="session")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_watch_streams_every_status_change() -> None:
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), ApiKeyCheck(["k"])])
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await health.set("", SERVING)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            seen = []
            async for reply in call:
                seen.append(reply.status)
                if reply.status == SERVING:
                    await health.set("", NOT_SERVING)
                else:
                    call.cancel()
                    break
    finally:
        await server.stop(0)
    assert seen == [SERVING, NOT_SERVING]
