"""The metrics port's ``/health``: what a Kubernetes probe reads, following the gRPC health status; with TLS the
port speaks HTTPS and only ``/metrics`` asks for a certificate the cluster's CA signed."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import httpx
import pytest
from helpers import make_pki

from services.common.metrics import serve_metrics
from services.common.rpc import Tls


def test_health_follows_the_serving_status_and_every_other_path_is_the_metrics():
    state = {"serving": True}
    address = serve_metrics("127.0.0.1", 0, lambda: state["serving"])
    reply = httpx.get(f"http://{address}/health", timeout=5)
    assert (reply.status_code, reply.json()) == (200, {"status": "serving"})
    state["serving"] = False
    reply = httpx.get(f"http://{address}/health?probe=liveness", timeout=5)
    assert (reply.status_code, reply.json()) == (503, {"status": "not serving"})
    metrics = httpx.get(f"http://{address}/metrics", timeout=5)
    assert metrics.status_code == 200 and "kvconductor_requests_total" in metrics.text


def client(ca: str, pki: Path) -> ssl.SSLContext:
    """Trusts ``ca`` and presents ``pki``'s node certificate."""
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(pki / "node.pem", pki / "node.key")
    return context


def test_with_tls_the_metrics_need_a_cluster_certificate_and_health_needs_none(tmp_path):
    (tmp_path / "ours").mkdir(), (tmp_path / "theirs").mkdir()
    ours, theirs = (make_pki(tmp_path / name, "node", "IP:127.0.0.1") for name in ("ours", "theirs"))
    tls = Tls.from_files(str(ours / "node.pem"), str(ours / "node.key"), str(ours / "ca.pem"))
    assert tls is not None
    address = serve_metrics("127.0.0.1", 0, lambda: True, tls.http_server_context())
    url, ca = f"https://{address}", str(ours / "ca.pem")
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"http://{address}/health", timeout=5)  # plaintext is not answered
    assert httpx.get(f"{url}/health", verify=ca, timeout=5).json() == {"status": "serving"}
    refused = httpx.get(f"{url}/metrics", verify=ca, timeout=5)
    assert refused.status_code == 401 and "client certificate" in refused.text
    with_cert = httpx.get(f"{url}/metrics", verify=client(ca, ours), timeout=5)
    assert with_cert.status_code == 200 and "kvconductor_requests_total" in with_cert.text
    with pytest.raises((httpx.ConnectError, httpx.ReadError)):  # another CA's certificate: the handshake fails
        httpx.get(f"{url}/metrics", verify=client(ca, theirs), timeout=5)


def test_a_client_that_never_finishes_its_handshake_delays_no_other(tmp_path):
    pki = make_pki(tmp_path, "node", "IP:127.0.0.1")
    tls = Tls.from_files(str(pki / "node.pem"), str(pki / "node.key"), str(pki / "ca.pem"))
    assert tls is not None
    address = serve_metrics("127.0.0.1", 0, lambda: True, tls.http_server_context())
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):  # connected, sends nothing
        # answered within 5 s while the silent client holds its connection (dropped after 10 s)
        assert httpx.get(f"https://{address}/health", verify=str(pki / "ca.pem"), timeout=5).status_code == 200
