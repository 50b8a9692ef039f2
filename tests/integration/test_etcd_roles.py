"""etcd users and roles per kvconductor role (cli/etcd_roles.py) on the embedded etcd with TLS: each certificate
writes its own role's records only; the gateway only reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_pki

from cli.etcd_roles import apply, root_channel
from cli.etcd_server import EmbeddedEtcd, EtcdTls
from services.common.instance_record import InstanceRecord
from services.common.registry import EtcdAuth, Registry, connect

ROLES = ("root", "kvmeta", "prefill", "gateway", "conductor")


def test_each_certificate_writes_only_its_own_roles_records(tmp_path: Path, cluster: str) -> None:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki", "etcd", "IP:127.0.0.1", ROLES)
    tls = EtcdTls(str(pki / "node.pem"), str(pki / "node.key"), str(pki / "ca.pem"))

    def auth(role: str) -> EtcdAuth:
        return EtcdAuth(str(pki / "ca.pem"), str(pki / f"{role}.pem"), str(pki / f"{role}.key"))

    with EmbeddedEtcd(run_dir=tmp_path / "etcd", tls=tls) as etcd:
        endpoint = f"127.0.0.1:{etcd.client_port}"
        with root_channel(endpoint, *(str(pki / f) for f in ("ca.pem", "root.pem", "root.key"))) as channel:
            added = apply(channel, cluster)
            assert "user gateway" in added and f"role kvconductor-{cluster}-prefill" in added
            assert apply(channel, cluster) == []  # run again: all there, nothing changes
        kvmeta = Registry(etcd.endpoint, cluster, auth=auth("kvmeta"))
        try:
            kvmeta.register(InstanceRecord("kvmeta", "k0", "127.0.0.1:1"))  # its own role's record
            prefix = f"/kvconductor/{cluster}/instances/"
            for role, key in (("prefill", "kvmeta/k0"), ("prefill", "decode/d"), ("gateway", "prefill/p"),
                              ("gateway", "conductor/c")):  # fmt: skip
                client = connect([("127.0.0.1", etcd.client_port)], 5.0, auth(role))
                try:
                    with pytest.raises(Exception, match="permission denied"):
                        client.put(prefix + key, "{}")
                finally:
                    client.close()
            for role in ("gateway", "conductor", "prefill"):  # every role reads the records
                reader = Registry(etcd.endpoint, cluster, auth=auth(role))
                try:
                    assert list(reader.list()) == [("kvmeta", "k0")]
                finally:
                    reader.close()
        finally:
            kvmeta.close()
        with pytest.raises(ConnectionError):  # a certificate the CA signed but no user's: refused
            connect([("127.0.0.1", etcd.client_port)], 3.0, EtcdAuth(str(pki / "ca.pem"), str(pki / "node.pem"),
                                                                        str(pki / "node.key")))  # fmt: skip
