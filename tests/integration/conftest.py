"""Fixtures of the integration tests that meet in etcd: one embedded etcd per module, a cluster name per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from cli.etcd_server import EmbeddedEtcd


@pytest.fixture(scope="module")
def etcd() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def cluster() -> str:
    """A per-test cluster name, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"
