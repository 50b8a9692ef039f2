"""``[cluster] tls_server_name``: one shared service certificate (no peer addresses in it) verifies on every channel."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import rpc

pytestmark = pytest.mark.asyncio(loop_scope="session")
NAME = "kvconductor.internal"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def shared_certificate(tmp_path_factory) -> Path:
    """A CA and one certificate naming only NAME, for serving and as a client, as cert-manager would issue it."""
    d = tmp_path_factory.mktemp("shared-pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=test CA", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "svc.key", "-out", "svc.csr", "-subj", f"/CN={NAME}",
             cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{NAME}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "svc.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "svc.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    return d


async def _check(address: str, tls: rpc.Tls) -> health_pb2.HealthCheckResponse:
    rpc.use_tls(tls)
    try:
        async with rpc.channel(address) as channel:
            return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        rpc.use_tls(None)


async def test_a_shared_certificate_verifies_with_the_server_name_and_not_without(shared_certificate):
    d = shared_certificate
    tls = rpc.Tls.from_files(str(d / "svc.pem"), str(d / "svc.key"), str(d / "ca.pem"), NAME)
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
