"""The etcd registry of a configured cluster: endpoints, lease TTL and credentials from ``[cluster]``."""

from __future__ import annotations

import os

from services.common.config import Config
from services.common.registry import EtcdAuth, Registry


def etcd_auth(config: Config) -> EtcdAuth | None:
    """The etcd client's TLS files and credentials from ``[cluster]`` (None when there are none)."""
    c = config.cluster
    password = os.environ.get("KVCONDUCTOR_ETCD_PASSWORD")
    if not (c.etcd_ca_file or c.etcd_cert_file or c.etcd_user):
        return None
    return EtcdAuth(
        c.etcd_ca_file or None, c.etcd_cert_file or None, c.etcd_key_file or None, c.etcd_user or None, password
    )


def cluster_registry(config: Config) -> Registry:
    """The registry of ``config``'s cluster (a running etcd is required)."""
    if not config.cluster.etcd_endpoints:
        raise ValueError("[cluster] etcd_endpoints is empty: `serve` needs a running etcd (`up` starts one)")
    return Registry(
        config.cluster.etcd_endpoints, config.cluster.name, ttl=config.cluster.lease_ttl_s, auth=etcd_auth(config)
    )
