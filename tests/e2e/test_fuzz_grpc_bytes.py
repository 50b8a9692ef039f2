"""Bytes that are not a message, sent to every method of every gRPC service of a live cluster.

Every server the cluster registered in etcd (kvmeta, the Conductor, prefill, decode and colocated workers) is
asked by reflection which services it serves; each method of each gets random bytes that do not parse as its
request type, truncations of a well-formed request and invalid UTF-8 in a string field. Each answers
INVALID_ARGUMENT naming the message type: never UNKNOWN, INTERNAL, a hang or a crash. Afterwards every
worker is still in the Conductor's status and a request still completes.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzzing import FUZZ
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import assume, given
from hypothesis import strategies as st

import kvconductor.v1
from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from services.common.registry import Registry

TIMEOUT_S = 30.0  # detects a hang; never a performance bound
SERVED_BY_EVERY_SERVER = (health_pb2, reflection_pb2)  # imported: their types are in the default pool
for module in pkgutil.iter_modules(kvconductor.v1.__path__):  # every request type into the default pool
    if module.name.endswith("_pb2"):
        importlib.import_module(f"kvconductor.v1.{module.name}")
# Bytes no message parses: a tag of wire type 7, a length past the end, a varint cut off, a varint of 11 bytes.
CORRUPT = [b"\x0f", b"\x0a\x10abc", b"\x08", b"\x08" + b"\xff" * 10 + b"\x01", b"\x00"]


def servers(cluster: Any) -> list[tuple[str, str]]:
    """(role, address) of every gRPC server in the cluster."""
    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        found = {record.address: record.role for record in registry.list().values()}
    found.setdefault(cluster.conductor, "conductor")
    assert {"kvmeta", "conductor", "prefill", "decode", "colocated"} <= set(found.values()), found
    return sorted((role, address) for address, role in found.items())


def methods_of(address: str) -> list[MethodDescriptor]:
    """The methods of every service the server's reflection lists."""
    with grpc.insecure_channel(address) as channel:
        names = ProtoReflectionDescriptorDatabase(channel).get_services()
    pool = descriptor_pool.Default()
    return [m for name in names for m in pool.FindServiceByName(name).methods]


@pytest.fixture(scope="module")
def targets(cluster: Any) -> list[tuple[str, str, MethodDescriptor]]:
    """(role, address, method) for every method on every server."""
    found = [(role, address, m) for role, address in servers(cluster) for m in methods_of(address)]
    services = {m.containing_service.full_name for _, _, m in found}
    assert {"kvconductor.v1.Prefill", "kvconductor.v1.Decode", "kvconductor.v1.KvMeta"} <= services, services
    return found


def parses(method: MethodDescriptor, data: bytes) -> bool:
    try:
        message_factory.GetMessageClass(method.input_type).FromString(data)
    except DecodeError:
        return False
    return True


def answer(address: str, method: MethodDescriptor, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Send raw bytes as the request of ``method``; the status it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    with grpc.insecure_channel(address) as channel:
        try:
            if method.client_streaming:
                for _ in channel.stream_stream(path)(iter([data]), timeout=TIMEOUT_S):
                    pass
            elif method.server_streaming:
                for _ in channel.unary_stream(path)(data, timeout=TIMEOUT_S):
                    pass
            else:
                channel.unary_unary(path)(data, timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def assert_refused(role: str, address: str, method: MethodDescriptor, data: bytes) -> None:
    assert not parses(method, data), data
    code, details = answer(address, method, data)
    where = f"{role} {address} {method.full_name} <- {data!r}"
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {code.name} {details}"
    assert method.input_type.full_name in details, f"{where}: {details}"


def invalid_utf8(method: MethodDescriptor) -> bytes | None:
    """A request whose first string field holds bytes that are not UTF-8 (None: the type has no string field)."""
    field = next((f for f in method.input_type.fields if f.type == FieldDescriptor.TYPE_STRING), None)
    if field is None:
        return None
    return bytes([field.number << 3 | 2, 2]) + b"\xff\xfe" if field.number < 16 else None


def truncations(method: MethodDescriptor) -> list[bytes]:
    """Prefixes of a request with every string and bytes field filled that do not parse."""
    request = message_factory.GetMessageClass(method.input_type)()
    for field in method.input_type.fields:
        if not field.is_repeated and field.type == FieldDescriptor.TYPE_STRING:
            setattr(request, field.name, "x" * 40)
        elif not field.is_repeated and field.type == FieldDescriptor.TYPE_BYTES:
            setattr(request, field.name, b"x" * 40)
    data = request.SerializeToString()
    return [data[:n] for n in range(1, len(data)) if not parses(method, data[:n])]


@pytest.fixture(scope="module")
def stub(cluster: Any) -> Iterator[conductor_pb2_grpc.ConductorStub]:
    with grpc.insecure_channel(cluster.conductor) as channel:
        yield conductor_pb2_grpc.ConductorStub(channel)


@pytest.fixture(autouse=True)
def still_serves(stub: conductor_pb2_grpc.ConductorStub, targets: list) -> Iterator[None]:
    """After each test: every worker is still listed and a request still completes."""
    yield
    workers = {address for role, address, _ in targets if role in ("prefill", "decode", "colocated")}
    assert workers <= {i.address for i in stub.GetStatus(conductor_pb2.GetStatusRequest(), timeout=TIMEOUT_S).instances}
    request = conductor_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    assert list(stub.Generate(request, timeout=60))[-1].usage.completion_tokens == 2


def test_corrupt_and_truncated_bytes_on_every_method(targets: list) -> None:
    seen = []
    for role, address, method in targets:
        cases = [*CORRUPT, *truncations(method)[::3]]
        if (utf8 := invalid_utf8(method)) is not None:
            cases.append(utf8)
        for data in cases:
            assert_refused(role, address, method, data)
        seen.append(f"{role:9} {method.full_name}: {len(cases)} x INVALID_ARGUMENT")
    print("\n".join(seen))


@FUZZ
@given(data=st.data())
def test_random_bytes_on_every_method(targets: list, data: st.DataObject) -> None:
    role, address, method = data.draw(st.sampled_from(targets))
    payload = data.draw(st.binary(min_size=1, max_size=256))
    assume(not parses(method, payload))
    assert_refused(role, address, method, payload)
