"""The table of who may call what (services/common/access.py): complete, and closed where it says so."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kvconductor.v1
from services.common.access import ANY_CERTIFICATE, CALLERS, ROLES, allowed, spiffe_id

MODULES = [importlib.import_module(f"kvconductor.v1.{m.name}") for m in pkgutil.iter_modules(kvconductor.v1.__path__)
           if m.name.endswith("_pb2") and not m.name.endswith("_grpc")]  # fmt: skip
METHODS = [f"/{s.full_name}/{m.name}" for mod in MODULES for s in mod.DESCRIPTOR.services_by_name.values()
           for m in s.methods]  # fmt: skip


def test_every_method_of_every_service_names_who_may_call_it():
    assert len(METHODS) >= 14  # every RPC of protos/kvconductor/v1
    for method in METHODS:
        roles = allowed(method)
        assert roles and roles is not ANY_CERTIFICATE, method
        assert roles <= set(ROLES), method


def test_every_table_entry_is_a_method_or_a_service_that_exists():
    services = {m[: m.rfind("/") + 1] for m in METHODS}
    for key in CALLERS:
        if key.startswith("/kvconductor."):
            assert key in METHODS or key in services, key


@pytest.mark.parametrize(
    ("method", "may", "may_not"),
    [
        ("/kvconductor.v1.Prefill/Prefill", {"conductor", "colocated"}, {"gateway", "prefill", "decode", "admin"}),
        ("/kvconductor.v1.Decode/Reserve", {"conductor"}, {"gateway", "prefill", "kvmeta"}),
        ("/kvconductor.v1.Decode/Release", {"conductor"}, {"gateway", "prefill"}),
        ("/kvconductor.v1.Prefill/ExportBlocks", {"prefill"}, {"gateway", "decode", "conductor"}),
        ("/kvconductor.v1.KvMeta/PublishEvents", {"prefill", "colocated"}, {"gateway", "conductor", "decode"}),
        ("/kvconductor.v1.Conductor/Generate", {"gateway", "admin"}, {"prefill", "decode", "kvmeta", "store"}),
    ],
)
def test_the_gateway_and_workers_reach_only_their_own_calls(method, may, may_not):
    assert may <= allowed(method)
    assert not may_not & allowed(method)


def test_an_unlisted_method_is_closed_and_health_is_open_to_any_certificate():
    assert allowed("/kvconductor.v1.Prefill/SomethingNew") == frozenset()
    assert allowed("/kvconductor.v2.Other/Call") == frozenset()
    assert allowed("/grpc.health.v1.Health/Check") is ANY_CERTIFICATE
    assert spiffe_id("decode") == "spiffe://kvconductor/decode"
