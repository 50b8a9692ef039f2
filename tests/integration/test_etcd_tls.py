"""The embedded etcd with TLS and client-certificate auth: the registry with the CA's certificate, nobody else."""

from __future__ import annotations

import ssl
import urllib.request
from pathlib import Path

import pytest
from helpers import make_pki

from cli.etcd_server import EmbeddedEtcd, EtcdTls
from services.common.instance_record import InstanceRecord
from services.common.registry import EtcdAuth, Registry, connect


def test_embedded_etcd_serves_tls_to_holders_of_a_certificate_the_ca_signed(tmp_path: Path, cluster: str) -> None:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", "etcd", "IP:127.0.0.1", ("prefill",))
    tls = EtcdTls(str(pki / "node.pem"), str(pki / "node.key"), str(pki / "ca.pem"))
    with EmbeddedEtcd(run_dir=tmp_path / "etcd", tls=tls) as etcd:
        assert etcd.client_url.startswith("https://")
        client = EtcdAuth(str(pki / "ca.pem"), str(pki / "prefill.pem"), str(pki / "prefill.key"))
        owner = Registry(etcd.endpoint, cluster, auth=client)
        try:
            owner.register(InstanceRecord("kvmeta", "k0", "127.0.0.1:1"))
            assert list(owner.list("kvmeta")) == [("kvmeta", "k0")]
        finally:
            owner.close()
        endpoint = ("127.0.0.1", etcd.client_port)
        for auth in (None, EtcdAuth(str(pki / "ca.pem"))):  # plaintext; TLS without a client certificate
            with pytest.raises(ConnectionError):
                connect([endpoint], 3.0, auth)
        no_certificate = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        for port in (etcd.client_port, etcd.peer_port):
            with pytest.raises(OSError):  # the handshake fails (TLS 1.3: the alert comes with the first read)
                urllib.request.urlopen(f"https://127.0.0.1:{port}/version", timeout=3, context=no_certificate).read()
            with pytest.raises(OSError):  # not HTTP in plaintext either
                urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=3).read()
