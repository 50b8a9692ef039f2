"""etcd users and roles, one per kvconductor role, so that a certificate can write only its own role's records.

etcd with ``--client-cert-auth`` and authentication enabled takes the user name from the client
certificate's common name. The cluster's certificates name their role there (``CN=prefill``; the SPIFFE URI
beside it is for gRPC), so each kvconductor role is an etcd user of that name, with one etcd role:

- every role reads the cluster's records (``/kvconductor/<cluster>/instances/``) and the key the
  registry's connection check reads (``/kvconductor/``);
- each role that registers (conductor, kvmeta, store, prefill, decode, colocated) also writes
  ``/kvconductor/<cluster>/instances/<role>/``, its own role's records, and nothing else;
- the gateway and the command line (``admin``) only read: a compromised gateway cannot register a worker.

``root`` (a certificate with ``CN=root``) runs this once and keeps etcd's own administration. Users get
a random password nobody knows, so only their certificate logs them in. Running it again adds what is
missing and changes nothing else.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc
from pyetcd.etcdrpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

from services.common.access import ROLES
from services.common.config import Config

log = logging.getLogger(__name__)
READERS = ("gateway", "admin")  # the roles that register nothing
ROOT = "root"


def _prefix_end(prefix: bytes) -> bytes:
    """The range end that makes ``prefix`` a prefix (etcd's convention: the prefix with its last byte + 1)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


@dataclass(frozen=True)
class Grant:
    """One permission of an etcd role."""

    kind: int  # auth_pb2.Permission.READ / READWRITE
    key: bytes
    range_end: bytes = b""  # "" = the key alone

    def permission(self) -> auth_pb2.Permission:
        """As etcd's message."""
        return auth_pb2.Permission(permType=self.kind, key=self.key, range_end=self.range_end)


def grants(cluster: str) -> dict[str, list[Grant]]:
    """The permissions of each kvconductor role in the cluster ``cluster``."""
    records = f"/kvconductor/{cluster}/instances/".encode()
    read = [Grant(auth_pb2.Permission.READ, b"/kvconductor/"), Grant(auth_pb2.Permission.READ, records,
                                                                         _prefix_end(records))]  # fmt: skip
    table = {}
    for role in ROLES:
        own = records + f"{role}/".encode()
        table[role] = read + ([] if role in READERS else [Grant(auth_pb2.Permission.READWRITE, own, _prefix_end(own))])
    return table


def _ignore_existing(call: grpc.UnaryUnaryMultiCallable, request: object) -> bool:
    """Make the call; False when what it adds exists already."""
    try:
        call(request, timeout=10)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "already" in (e.details() or ""):
            return False
        raise
    return True


def apply(channel: grpc.Channel, cluster: str) -> list[str]:
    """Create the users, roles and grants of ``cluster`` and enable authentication; return what was added."""
    auth = rpc_pb2_grpc.AuthStub(channel)
    added = []
    for name in (ROOT, *ROLES):
        password = secrets.token_hex(32)  # never used: the certificate's common name logs the user in
        if _ignore_existing(auth.UserAdd, rpc_pb2.AuthUserAddRequest(name=name, password=password)):
            added.append(f"user {name}")
    auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=ROOT, role=ROOT), timeout=10)
    for role, permissions in grants(cluster).items():
        etcd_role = f"kvconductor-{cluster}-{role}"
        if _ignore_existing(auth.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=etcd_role)):
            added.append(f"role {etcd_role}")
        for grant in permissions:
            auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=etcd_role, perm=grant.permission()),
                                     timeout=10)  # fmt: skip
        auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=role, role=etcd_role), timeout=10)
    auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=10)
    return added


def root_channel(endpoint: str, ca_file: str, cert_file: str, key_file: str) -> grpc.Channel:
    """A TLS channel to etcd presenting the root certificate (``CN=root``)."""
    credentials = grpc.ssl_channel_credentials(*(Path(f).read_bytes() for f in (ca_file, key_file, cert_file)))
    return grpc.secure_channel(endpoint, credentials)


def main(config: Config) -> int:
    """``kvconductor etcd-roles``: with ``[cluster] etcd_cert_file`` a root certificate."""
    c = config.cluster
    if not (c.etcd_endpoints and c.etcd_ca_file and c.etcd_cert_file and c.etcd_key_file):
        raise ValueError("etcd-roles needs [cluster] etcd_endpoints, etcd_ca_file, etcd_cert_file and etcd_key_file "
                         "(the certificate of etcd's root user: CN=root)")  # fmt: skip
    with root_channel(c.etcd_endpoints[0], c.etcd_ca_file, c.etcd_cert_file, c.etcd_key_file) as channel:
        try:
            added = apply(channel, c.name)
        except grpc.RpcError as e:
            raise RuntimeError(f"etcd at {c.etcd_endpoints[0]} refused: {e.code().name} {e.details()}") from None
    print(f"etcd authentication on for cluster {c.name!r}; added: {', '.join(added) or 'nothing (all there)'}")
    return 0
