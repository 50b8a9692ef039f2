"""``[cluster] tls_server_name``: one shared service certificate (no peer addresses in it) verifies on every channel."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from helpers import make_pki

from services.common import rpc

pytestmark = pytest.mark.asyncio(loop_scope="session")
NAME = "kvconductor.internal"


@pytest.fixture(scope="module")
def shared_certificate(tmp_path_factory) -> Path:
    """A CA and one certificate naming only NAME, for serving and as a client, as cert-manager would issue it."""
    return make_pki(tmp_path_factory.mktemp("shared-pki"), NAME, f"DNS:{NAME}")


async def _check(address: str, tls: rpc.Tls) -> health_pb2.HealthCheckResponse:
    rpc.use_tls(tls)
    try:
        async with rpc.channel(address) as channel:
            return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        rpc.use_tls(None)


async def test_a_shared_certificate_verifies_with_the_server_name_and_not_without(shared_certificate):
    d = shared_certificate
    tls = rpc.Tls.from_files(str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem"), NAME)
    assert tls is not None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(mutual=True))
    await server.start()
    try:
        reply = await _check(f"127.0.0.1:{port}", tls)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # the certificate does not name 127.0.0.1
            await _check(f"127.0.0.1:{port}", rpc.Tls(tls.cert, tls.key, tls.ca))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
