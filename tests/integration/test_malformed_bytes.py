"""Bytes that are not a message, through the interceptors every service runs: INVALID_ARGUMENT, or first the key.

A real grpc.aio server with the chain :func:`services.common.rpc.serve` builds (errors, then API keys) and the
Conductor's keyed service (a servicer that answers every status call): well-formed bytes reach it, malformed ones
never do, and without a key they are not even parsed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc
from services.common.api_keys import ApiKeyCheck
from services.common.rpc import ErrorInterceptor

KEY = (("authorization", "Bearer k"),)
STATUS = "/kvconductor.v1.Conductor/GetStatus"
REFLECT = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
pytestmark = pytest.mark.asyncio(loop_scope="session")
CORRUPT = b"\x0a\x10abc"  # field 1, 16 bytes long, 3 bytes sent


class AnsweringConductor(conductor_pb2_grpc.ConductorServicer):
    async def GetStatus(self, request, context):  # noqa: N802 - the generated method name
        return conductor_pb2.GetStatusResponse()


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), ApiKeyCheck(["k"])])
    conductor_pb2_grpc.add_ConductorServicer_to_server(AnsweringConductor(), server)
    reflection.enable_server_reflection(["kvconductor.v1.Conductor", reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def code_of(
    address: str, method: str, data: bytes, metadata: tuple = (), streaming: bool = False
) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            if streaming:
                call = channel.stream_stream(method)(iter([data]), metadata=metadata, timeout=10)
                async for _ in call:
                    pass
            else:
                await channel.unary_unary(method)(data, metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def test_malformed_bytes_with_a_key_are_invalid_argument_naming_the_message(address: str) -> None:
    code, details = await code_of(address, STATUS, CORRUPT, KEY)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in details and "GetStatusRequest" in details
    well_formed = conductor_pb2.GetStatusRequest().SerializeToString()
    assert (await code_of(address, STATUS, well_formed, KEY))[0] == grpc.StatusCode.OK


async def test_without_a_key_the_bytes_are_never_parsed(address: str) -> None:
    code, details = await code_of(address, STATUS, CORRUPT)
    assert code == grpc.StatusCode.UNAUTHENTICATED, details
    assert "GetStatusRequest" not in details


async def test_a_malformed_message_in_a_client_stream_ends_the_call(address: str) -> None:
    """Reflection is stream-stream and open without a key."""
    code, details = await code_of(address, REFLECT, CORRUPT, streaming=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "ServerReflectionRequest" in details
    good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    assert (await code_of(address, REFLECT, good, streaming=True))[0] == grpc.StatusCode.OK
