"""TLS: HTTPS on the REST shim, mutual TLS on gRPC between every service (self-signed CA made here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from helpers import running_cluster

from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA and one certificate for 127.0.0.1, good for serving and as a client."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kvconductor test CA", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node",
             cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, model_dir, pki):
    with running_cluster(
        tmp_path_factory.mktemp("tls") / "run", model_dir, "prefill.node_count=1", "decode.node_count=1",
        f'cluster.tls_cert_file="{pki / "node.pem"}"', f'cluster.tls_key_file="{pki / "node.key"}"',
        f'cluster.tls_ca_file="{pki / "ca.pem"}"', f'gateway.tls_cert_file="{pki / "node.pem"}"',
        f'gateway.tls_key_file="{pki / "node.key"}"',
    ) as c:  # fmt: skip
        yield c


def test_rest_over_https(tls_cluster, pki):
    assert tls_cluster.rest.startswith("https://")
    client = openai.OpenAI(
        base_url=tls_cluster.rest, api_key="unused", http_client=httpx.Client(verify=str(pki / "ca.pem"))
    )
    reply = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3  # the whole path ran: gateway, Conductor, prefill, decode
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_cluster.rest.replace("https://", "http://") + "/models", timeout=5).raise_for_status()


def test_grpc_requires_a_certificate_the_ca_signed(tls_cluster, pki):
    request = conductor_pb2.GetStatusRequest()
    ca, cert, key = ((pki / name).read_bytes() for name in ("ca.pem", "node.pem", "node.key"))
    mutual = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    with grpc.secure_channel(tls_cluster.conductor, mutual) as channel:
        status = conductor_pb2_grpc.ConductorStub(channel).GetStatus(request, timeout=10)
    assert {i.role for i in status.instances} == {"prefill", "decode"}
    for credentials in (None, grpc.ssl_channel_credentials(root_certificates=ca)):  # plaintext; TLS without a cert
        channel = (
            grpc.insecure_channel(tls_cluster.conductor)
            if credentials is None
            else grpc.secure_channel(tls_cluster.conductor, credentials)
        )
        with channel, pytest.raises(grpc.RpcError) as refused:
            conductor_pb2_grpc.ConductorStub(channel).GetStatus(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
