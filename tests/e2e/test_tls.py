"""TLS: HTTPS on the REST shim, mutual TLS with roles on gRPC between the services, API keys on the public API.

A self-signed CA made here signs a certificate per role (URI SAN ``spiffe://kvconductor/ROLE``; the
config names them ``{role}.pem``). With API keys (``[gateway] api_keys_file``) the Conductor's port takes
TLS without a client certificate and wants a key; every other gRPC port (workers, kvmeta) takes only
callers holding a certificate the CA signed, and of those only the roles that may call each method.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import make_pki, running_cluster

from kvconductor.v1 import (
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    kvmeta_pb2,
    kvmeta_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.access import ROLES

KEY = "tls-test-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a certificate per role and one naming no role, for 127.0.0.1, good for serving and as a client."""
    return make_pki(tmp_path_factory.mktemp("pki"), "node", "IP:127.0.0.1,DNS:localhost", ROLES)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, model_dir, pki):
    keys = pki / "api-keys"
    keys.write_text(f"# the cluster's bearer keys\n{KEY}\n")
    with running_cluster(
        tmp_path_factory.mktemp("tls") / "run", model_dir,
        "prefill.node_count=1", "decode.node_count=1", "colocated.node_count=1",
        f'cluster.tls_cert_file="{pki / "{role}.pem"}"', f'cluster.tls_key_file="{pki / "{role}.key"}"',
        f'cluster.tls_ca_file="{pki / "ca.pem"}"', f'gateway.tls_cert_file="{pki / "node.pem"}"',
        f'gateway.tls_key_file="{pki / "node.key"}"', f'gateway.api_keys_file="{keys}"',
    ) as c:  # fmt: skip
        yield c


def test_rest_over_https(tls_cluster, pki):
    assert tls_cluster.rest.startswith("https://")
    client = openai.OpenAI(base_url=tls_cluster.rest, api_key=KEY, http_client=httpx.Client(verify=str(pki / "ca.pem")))
    reply = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3  # the whole path ran: gateway, Conductor, prefill, decode
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_cluster.rest.replace("https://", "http://") + "/models", timeout=5).raise_for_status()


def _credentials(pki, certificate=None):
    """TLS as ``certificate`` (a role, or "node": a certificate without one); None: no client certificate."""
    ca = (pki / "ca.pem").read_bytes()
    if certificate is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, key = ((pki / f"{certificate}.{ext}").read_bytes() for ext in ("pem", "key"))
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _generate(channel, metadata):
    request = conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=list(range(40, 60))),
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    return [t for m in conductor_pb2_grpc.ConductorStub(channel).Generate(request, metadata=metadata, timeout=60)
            for t in m.token_ids]  # fmt: skip


def test_the_public_grpc_api_wants_an_api_key(tls_cluster, pki):
    bearer = [("authorization", f"Bearer {KEY}")]
    with grpc.secure_channel(tls_cluster.conductor, _credentials(pki)) as channel:
        for metadata in ((), [("authorization", "Bearer wrong")]):  # no key; a wrong one
            with pytest.raises(grpc.RpcError) as refused:
                _generate(channel, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
            assert "API key" in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                conductor_pb2_grpc.ConductorStub(channel).GetStatus(conductor_pb2.GetStatusRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no key
        assert len(_generate(channel, bearer)) == 3  # with the key, a client without a certificate is served
        status = conductor_pb2_grpc.ConductorStub(channel).GetStatus(conductor_pb2.GetStatusRequest(), metadata=bearer)
    assert {i.role for i in status.instances} == {"prefill", "decode", "colocated"}
    with grpc.insecure_channel(tls_cluster.conductor) as channel, pytest.raises(grpc.RpcError) as refused:
        _generate(channel, bearer)  # plaintext: no TLS handshake, no call
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _records(cluster):
    from services.common.registry import Registry

    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        return {role: next(iter(registry.list(role).values())) for role in ("prefill", "decode", "kvmeta", "colocated")}


def test_worker_and_kvmeta_ports_take_only_the_roles_that_may_call_each_method(tls_cluster, pki):
    records = _records(tls_cluster)
    calls = {  # method: (the server's role, the role that may call it, the call)
        "ExportBlocks": ("prefill", "prefill", lambda ch: prefill_pb2_grpc.PrefillStub(ch).ExportBlocks(
            prefill_pb2.ExportBlocksRequest(), timeout=10)),
        "Reserve": ("decode", "conductor", lambda ch: decode_pb2_grpc.DecodeStub(ch).Reserve(
            decode_pb2.ReserveRequest(request_id="tls-probe", num_prompt_tokens=16,
                                   sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=10)),
        "Release": ("decode", "conductor", lambda ch: decode_pb2_grpc.DecodeStub(ch).Release(
            decode_pb2.ReleaseRequest(request_id="tls-probe"), timeout=10)),
        "MatchPrefix": ("kvmeta", "conductor", lambda ch: kvmeta_pb2_grpc.KvMetaStub(ch).MatchPrefix(
            kvmeta_pb2.MatchPrefixRequest(block_hashes=[b"\x00" * 32]), timeout=10)),
        "Follow": ("kvmeta", "conductor", lambda ch: next(kvmeta_pb2_grpc.KvMetaStub(ch).Follow(
            kvmeta_pb2.FollowRequest(), timeout=10))),
        "PublishEvents": ("kvmeta", "prefill", lambda ch: kvmeta_pb2_grpc.KvMetaStub(ch).PublishEvents(
            kvmeta_pb2.PublishEventsRequest(instance_id="prefill-0"), timeout=10)),
    }  # fmt: skip
    for name, (server, role, call) in calls.items():
        address = records[server].address
        for credentials in (None, _credentials(pki)):  # plaintext; TLS without a certificate
            channel = (
                grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
            )
            with channel, pytest.raises(grpc.RpcError) as refused:
                call(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (name, refused.value)
        for other in ("node", "gateway", "decode"):  # a certificate without a role; roles that may not call it
            with (
                grpc.secure_channel(address, _credentials(pki, other)) as channel,
                pytest.raises(grpc.RpcError) as refused,
            ):
                call(channel)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, other, refused.value)
            assert name in refused.value.details() and role in refused.value.details()
        with grpc.secure_channel(address, _credentials(pki, role)) as channel:
            call(channel)  # the role that may call it gets through


def test_a_colocated_workers_own_endpoints_take_tls_certificates_and_keys(tls_cluster, pki):
    """Its OpenAI endpoint is HTTPS and wants a key; its Conductor (on its gRPC port) a role and a key."""
    record = _records(tls_cluster)["colocated"]
    assert record.openai_url.startswith("https://")
    client = openai.OpenAI(
        base_url=record.openai_url + "/v1", api_key=KEY, http_client=httpx.Client(verify=str(pki / "ca.pem"))
    )
    reply = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2
    unkeyed = httpx.get(record.openai_url + "/v1/models", verify=str(pki / "ca.pem"), timeout=10)
    assert unkeyed.status_code == 401
    with grpc.secure_channel(record.address, _credentials(pki, "gateway")) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _generate(channel, ())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(_generate(channel, [("authorization", f"Bearer {KEY}")])) == 3
    with grpc.secure_channel(record.address, _credentials(pki, "prefill")) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _generate(channel, [("authorization", f"Bearer {KEY}")])  # a key, but a role that may not call it
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
