"""What a caller gets on each port of a cluster: run on another host, as one identity (tests/e2e/test_netns_trust.py).

``python tests/trust_probe.py REQUEST.json`` prints one JSON object: for each target of the request, what
each attempt answered. The request::

    {"identity": {"ca": PATH, "cert": PATH or null, "key": PATH or null},
     "targets": [{"address": "HOST:PORT", "kind": "grpc" | "metrics" | "rest" | "etcd" | "etcd-peer" | "tcp"}]}

An identity without a certificate knows only the CA's certificate (public): it can check whom it talks to
but has no credential. Every attempt is bounded (``TIMEOUT_S``); nothing here changes the cluster's state
except a key under ``/trust-probe/`` in etcd, written and deleted at once where etcd lets the caller write.
"""

from __future__ import annotations

import base64
import json
import socket
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from kvconductor.v1 import colocated_pb2, conductor_pb2, decode_pb2, kvmeta_pb2, prefill_pb2, worker_pb2

TIMEOUT_S = 5.0
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
              "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")  # fmt: skip
# The gateway's REST routes (services/gateway/gateway.py ROUTES) with a valid body each, so that a refusal is the
# key check's and not the body's validation.
REST_CALLS = (
    ("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/get_load", None), ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions",
     {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
)  # fmt: skip
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a gRPC client sends first once TLS is up


def grpc_methods() -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every kvconductor RPC, health's and reflection's."""
    methods = []
    for module in (conductor_pb2, prefill_pb2, decode_pb2, worker_pb2, colocated_pb2, kvmeta_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods += [(f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming)
                        for m in service.methods]  # fmt: skip
    return [*methods, (HEALTH + "Check", False, False), (HEALTH + "Watch", False, True),
            *((path, True, True) for path in REFLECTION)]  # fmt: skip


def _request(path: str) -> bytes:
    if path in REFLECTION:
        return reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    if path.startswith(HEALTH):
        return health_pb2.HealthCheckRequest().SerializeToString()
    return b""  # the empty message: valid for every request type


def _call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool) -> dict[str, Any]:
    """One call with an empty request: its status code (OK once a reply came) and details."""
    request = _request(path)
    try:
        if client_streaming:
            replies = channel.stream_stream(path)(iter([request]), timeout=TIMEOUT_S)
            reply = next(replies)
            replies.cancel()
        elif server_streaming:
            replies = channel.unary_stream(path)(request, timeout=TIMEOUT_S)
            reply = next(replies)
            replies.cancel()
        else:
            reply = channel.unary_unary(path)(request, timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": (e.details() or "")[:160]}
    except StopIteration:
        return {"code": "OK", "details": "no message"}
    result: dict[str, Any] = {"code": "OK", "details": f"{len(reply)} bytes"}
    if path in REFLECTION:
        listed = reflection_pb2.ServerReflectionResponse.FromString(reply).list_services_response
        result["services"] = sorted(s.name for s in listed.service)
    return result


def _tls_context(identity: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=identity["ca"])
    context.check_hostname = False  # the CA is checked; the address is the certificate's business elsewhere
    if identity.get("cert"):
        context.load_cert_chain(identity["cert"], identity["key"])
    return context


def _short(error: BaseException) -> str:
    text = str(getattr(error, "reason", "") or error) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:160]


def tls_handshake(host: str, port: int, identity: dict[str, Any], first: bytes = PREFACE, alpn: str = "") -> str:
    """Whether TLS comes up and the server then talks (``first`` sent, ``alpn`` offered): with TLS 1.3 a missing
    client certificate shows on the first read after the handshake (the server's alert, or it closes)."""
    context = _tls_context(identity)
    if alpn:
        context.set_alpn_protocols([alpn])
    try:
        with socket.create_connection((host, port), TIMEOUT_S) as raw:
            raw.settimeout(TIMEOUT_S)
            with context.wrap_socket(raw, server_hostname=host) as tls:
                version = tls.version()
                tls.sendall(first)
                data = tls.recv(64)
    except (OSError, ssl.SSLError) as e:
        return f"refused: {_short(e)}"
    return f"{version} up, server answered {len(data)} bytes" if data else f"{version} up, server closed"


def probe_grpc(address: str, identity: dict[str, Any]) -> dict[str, Any]:
    """Plaintext, the TLS handshake, then every method over TLS as ``identity``."""
    with grpc.insecure_channel(address) as plain:
        plaintext = _call(plain, HEALTH + "Check", False, False)
    ca = Path(identity["ca"]).read_bytes()
    cert = Path(identity["cert"]).read_bytes() if identity.get("cert") else None
    key = Path(identity["key"]).read_bytes() if identity.get("key") else None
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    host, _, port = address.rpartition(":")
    handshake = tls_handshake(host, int(port), identity, alpn="h2")  # gRPC's HTTP/2: the server's SETTINGS come back
    result: dict[str, Any] = {"plaintext": plaintext, "tls": handshake, "methods": {}}
    with grpc.secure_channel(address, credentials) as channel:
        for path, client_streaming, server_streaming in grpc_methods():
            result["methods"][path] = _call(channel, path, client_streaming, server_streaming)
    return result


def _http(url: str, identity: dict[str, Any] | None, method: str = "GET", body: Any = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    context = _tls_context(identity) if url.startswith("https") and identity is not None else None
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as reply:
            return {"status": reply.status, "body": reply.read(4096).decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read(300).decode(errors="replace")}
    except (OSError, ValueError) as e:
        return {"status": None, "error": _short(e)}


def probe_metrics(address: str, identity: dict[str, Any]) -> dict[str, Any]:
    """A gRPC process's metrics port: /health and /metrics over HTTPS as ``identity``, and in plaintext."""
    result = {f"GET {path}": _http(f"https://{address}{path}", identity) for path in ("/health", "/metrics")}
    result["plaintext GET /metrics"] = _http(f"http://{address}/metrics", None)
    return result


def probe_rest(address: str, identity: dict[str, Any]) -> dict[str, Any]:
    """The gateway's REST API without a key: every route over HTTPS, and plaintext HTTP."""
    result = {f"{method} {path}": _http(f"https://{address}{path}", identity, method, body)
              for method, path, body in REST_CALLS}  # fmt: skip
    result["plaintext GET /v1/models"] = _http(f"http://{address}/v1/models", None)
    return result


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def probe_etcd(address: str, identity: dict[str, Any], peer: bool = False) -> dict[str, Any]:
    """etcd's client port (or its peer port): plaintext, TLS as ``identity``; where it answers, a read of the
    cluster's keys and a write (and delete) of a probe key."""
    host, _, port = address.rpartition(":")
    result = {
        "plaintext GET /version": _http(f"http://{address}/version", None),
        "tls": tls_handshake(host, int(port), identity, b"GET /version HTTP/1.1\r\nHost: etcd\r\n\r\n"),
        "GET /version": _http(f"https://{address}/version", identity),
    }
    if peer or result["GET /version"]["status"] != 200:
        return result
    keys = {"key": _b64("/kvconductor/"), "range_end": _b64("/kvconductor0"), "count_only": True}
    result["read /kvconductor/"] = _http(f"https://{address}/v3/kv/range", identity, "POST", keys)
    probe = _b64("/trust-probe/" + (identity.get("cert") or "none").rsplit("/", 1)[-1])
    result["write /trust-probe/"] = _http(f"https://{address}/v3/kv/put", identity, "POST",
                                          {"key": probe, "value": _b64("probe")})  # fmt: skip
    if result["write /trust-probe/"]["status"] == 200:
        _http(f"https://{address}/v3/kv/deleterange", identity, "POST", {"key": probe})
    return result


def probe_tcp(address: str) -> dict[str, Any]:
    """A plain TCP connect and a few bytes (a port without a protocol of ours: the transfer engine's)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), TIMEOUT_S) as s:
            s.settimeout(2.0)
            s.sendall(b"kvconductor trust probe\r\n\r\n")
            try:
                data = s.recv(256)
                answer = f"answered {len(data)} bytes" if data else "closed by the server"
            except TimeoutError:
                answer = "no answer in 2 s"
            except OSError as e:
                answer = _short(e)
    except OSError as e:
        return {"connect": f"refused: {_short(e)}"}
    return {"connect": "accepted", "after 27 bytes": answer}


def probe(target: dict[str, str], identity: dict[str, Any]) -> dict[str, Any]:
    """What ``identity`` gets at ``target``."""
    kind, address = target["kind"], target["address"]
    if kind == "grpc":
        return probe_grpc(address, identity)
    if kind == "metrics":
        return probe_metrics(address, identity)
    if kind == "rest":
        return probe_rest(address, identity)
    if kind in ("etcd", "etcd-peer"):
        return probe_etcd(address, identity, peer=kind == "etcd-peer")
    result = probe_tcp(address)
    host, _, port = address.rpartition(":")
    result["tls"] = tls_handshake(host, int(port), identity)
    return result


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    results = {t["address"]: probe(t, request["identity"]) for t in request["targets"]}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
