"""The trust model across hosts (issue 27's acceptance test): every port of every process, tried from outside.

Four hosts as network namespaces (``tests/netns.py``), the hub routing between them (a flat network)::

    root namespace = hub                       netns P           netns D           netns X
      etcd (TLS, client certificates),   ──veth──  prefill-p  ──veth──  decode-d  ──veth──  no cluster process:
      kvmeta-0, conductor-0, gateway-0                                                     the outsider

No ``insecure_network``: mutual TLS with a certificate per role (URI SAN ``spiffe://kvconductor/ROLE``),
etcd over TLS asking for a client certificate (each process presents its own), API keys on the gateway's
HTTPS port and on the Conductor's public gRPC port. The test lists every TCP socket each process listens on
(``bind_guard.listeners``, children included), names it from the etcd records, and tries each one
(``tests/trust_probe.py``) from host X holding no certificate (only the CA's, which is public), then from the
gateway's host with the gateway's certificate (role gateway: a compromised gateway) but no API key: every
gRPC method of every kvconductor service, health and reflection on every gRPC port, every REST route, etcd's
client and peer ports, the metrics ports, the transfer engine's. It prints the table (``pytest -s``) and
fails with it attached when a port answers what the trust model does not allow (services/common/access.py,
services/common/config.py ``check_trust``):

* gRPC without a certificate: the TLS handshake fails (UNAVAILABLE), plaintext too; the Conductor's public
  port takes TLS without a certificate and wants the key (UNAUTHENTICATED), health and reflection open;
* gRPC with the gateway's certificate: PERMISSION_DENIED on every method ``access.CALLERS`` keeps from the
  gateway, UNIMPLEMENTED where the port does not serve the method, health and reflection open;
* REST without a key: 401 except the routes in ``OPEN_ROUTES``; plaintext HTTP on the HTTPS port fails;
* a metrics port: HTTPS, ``/health`` to anyone (the kubelet's probes), ``/metrics`` to a cluster certificate;
* etcd without a client certificate: refused on both ports; with one, each role's etcd user
  (cli/etcd_roles.py, applied before the cluster starts) writes only its own role's records: the gateway's
  certificate reads, never writes;
* the Mooncake Transfer Engine has no credential: a TCP connect from another host of the network gets in
  (a NetworkPolicy keeps it to the workers in Kubernetes); what is checked is that it listens on the worker's
  ``[cluster] host`` only (services/worker/kv/bind_guard.py), as every port does (no wildcard).

What the trust model does not settle is printed as a finding, not failed: etcd's peer port taking the TLS
handshake of any certificate the CA signed that names the caller's address, and the transfer engine's ports,
open to a TCP connect from any host of the network. Then the same cluster serves greedy
requests through the gateway (HTTPS, with the key), exactly as the engine in this process does, before and
after the probes.
"""

from __future__ import annotations

import collections
import ipaddress
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
from helpers import _descendants, make_pki, reference_tokens
from netns import Net, skip_reason
from netns import hosts as netns_hosts

from cli.etcd_roles import apply as etcd_roles
from cli.etcd_roles import root_channel
from cli.etcd_server import EtcdTls
from engine.tokenizer import load_tokenizer
from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from services.common.access import ANY_CERTIFICATE, ROLES, allowed
from services.common.instance_record import WorkerRecord
from services.common.net import free_port
from services.common.registry import EtcdAuth, Registry, connect
from services.worker.kv.bind_guard import listeners

if (_reason := skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

KEY = "netns-trust-key"
MAX_TOKENS = 12
PROBE_TIMEOUT_S = 150
# REST routes that answer without a key, and why. Any other route must answer 401.
OPEN_ROUTES = {"GET /health": "load balancers and probes (it says only whether a Conductor serves)"}
ROOT = Path(__file__).resolve().parents[2]


def _sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[SimpleNamespace]:
    """The four hosts, the PKI naming every cluster address, the cluster up; torn down whatever happens."""
    scratch = tmp_path_factory.mktemp("netns-trust")
    pki = scratch / "pki"
    pki.mkdir()

    def etcd_tls(net: Net) -> EtcdTls:
        # One certificate per role, each naming every cluster address (each process checks its peers' addresses).
        cluster_hosts = [net.hub, net.hosts["p"]["address"], net.hosts["d"]["address"]]
        make_pki(pki, "kvconductor", ",".join(f"IP:{a}" for a in cluster_hosts), (*ROLES, "root"))
        return EtcdTls(str(pki / "node.pem"), str(pki / "node.key"), str(pki / "ca.pem"))

    with netns_hosts(scratch, "p", "d", "x", forward=True, etcd_tls=etcd_tls) as (net, processes, etcd):
        with root_channel(etcd.endpoint, *(str(pki / f) for f in ("ca.pem", "root.pem", "root.key"))) as channel:
            etcd_roles(channel, "local")  # each certificate (CN=ROLE) writes only its own role's records
        (pki / "api-keys").write_text(f"# the cluster's bearer keys\n{KEY}\n")
        conductor, gateway = f"{net.hub}:{free_port()}", f"{net.hub}:{free_port()}"
        common = ["--config", "deploy/config.toml", *_sets(
            f'model.path="{model_dir}"', 'model.name="tiny-llama"', f'cluster.etcd_endpoints=["{etcd.endpoint}"]',
            f'cluster.scheduler_endpoint="{conductor}"', "prefill.kv_cache_memory_mb=64",
            "decode.kv_cache_memory_mb=64", "scheduler.reject_on_slo_violation=false",
            "cluster.kv_transfer_timeout_s=10", f'telemetry.trace_dir="{scratch / "traces"}"',
            f'cluster.tls_cert_file="{pki / "{role}.pem"}"', f'cluster.tls_key_file="{pki / "{role}.key"}"',
            f'cluster.tls_ca_file="{pki / "ca.pem"}"', f'cluster.etcd_ca_file="{pki / "ca.pem"}"',
            f'gateway.api_keys_file="{pki / "api-keys"}"', f'gateway.host="{net.hub}"',
            f"gateway.port={gateway.rpartition(':')[2]}", f'gateway.tls_cert_file="{pki / "gateway.pem"}"',
            f'gateway.tls_key_file="{pki / "gateway.key"}"',
        )]  # fmt: skip

        def on(address: str, role: str) -> list[str]:
            """On host ``address``, presenting the role's own certificate to etcd too (as each pod does)."""
            return [*common, *_sets(f'cluster.host="{address}"', f'cluster.etcd_cert_file="{pki}/{role}.pem"',
                                    f'cluster.etcd_key_file="{pki}/{role}.key"')]  # fmt: skip

        p, d = net.hosts["p"], net.hosts["d"]
        plan = [
            ("kvmeta", "kvmeta-0", net.hub, None), ("conductor", "conductor-0", net.hub, None),
            ("prefill", "prefill-p", p["address"], p["ns"]), ("decode", "decode-d", d["address"], d["ns"]),
        ]  # fmt: skip
        for role, instance_id, address, ns in plan:
            processes.start(role, instance_id, on(address, role), ns)
        processes.start("gateway", "gateway-0", on(net.hub, "gateway"))
        auth = EtcdAuth(str(pki / "ca.pem"), str(pki / "admin.pem"), str(pki / "admin.key"))
        processes.wait_registered(etcd.endpoint, [(role, instance_id) for role, instance_id, _, _ in plan], 240, auth)
        deadline = time.monotonic() + 60
        while True:
            processes.check_alive()
            try:
                if httpx.get(f"https://{gateway}/health", verify=str(pki / "ca.pem"), timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (
                f"the gateway never became healthy:\n{processes.log('gateway-0')[-2000:]}"
            )
            time.sleep(0.3)
        yield SimpleNamespace(net=net, processes=processes, etcd=etcd, pki=pki, auth=auth, conductor=conductor,
                              gateway=gateway, model_dir=model_dir, scratch=scratch,
                              hosts={"kvmeta-0": net.hub, "conductor-0": net.hub, "gateway-0": net.hub,
                                     "prefill-p": p["address"], "decode-d": d["address"], "etcd": net.hub})  # fmt: skip


# Serving through the gateway, over HTTPS with the key.


def _completion(cluster: SimpleNamespace, prompt: list[int]) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"https://{cluster.gateway}/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"}, verify=str(cluster.pki / "ca.pem"))  # fmt: skip
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _generate(cluster: SimpleNamespace, prompt: list[int]) -> tuple[list[int], str]:
    """Token ids and the decode worker of a greedy request to the Conductor's public port: TLS and the key."""
    request = conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=prompt), deployment=conductor_pb2.DEPLOYMENT_DISAGGREGATED,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        include_decision=True,
    )  # fmt: skip
    credentials = grpc.ssl_channel_credentials(root_certificates=(cluster.pki / "ca.pem").read_bytes())
    tokens, decode = [], ""
    with grpc.secure_channel(cluster.conductor, credentials) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        for message in stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")], timeout=120):
            tokens += message.token_ids
            decode = decode or (message.decision.decode_instance if message.HasField("decision") else "")
    return tokens, decode


def _serves_exactly(cluster: SimpleNamespace, seed: int, count: int) -> None:
    """Greedy output through the gateway (text) and the Conductor (token ids) equals the in-process engine's,
    the KV crossing from the prefill host to the decode host."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(40, 300))] for _ in range(count)]
    expected = reference_tokens(cluster.model_dir, prompts, MAX_TOKENS)
    tokenizer = load_tokenizer(str(cluster.model_dir))
    before = cluster.net.tx_bytes("d")
    texts = [_completion(cluster, p) for p in prompts]
    assert texts == [tokenizer.decode(t, skip_special_tokens=True) for t in expected]
    assert [_generate(cluster, p) for p in prompts] == [(t, "decode-d") for t in expected]
    kv_bytes = 2 * sum(len(p) for p in prompts) * 4096  # each prompt twice; 4 KiB of KV per token (tiny-llama, fp32)
    crossed = cluster.net.tx_bytes("d") - before
    assert crossed >= kv_bytes, f"only {crossed} bytes reached the decode host for {kv_bytes} bytes of KV"


def test_serves_greedy_requests_exactly_over_https_with_the_key(cluster):
    _serves_exactly(cluster, 7, 3)


# Every listening port, tried from host X and from the gateway's host.


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` or a child of it listens on, in its namespace."""
    found = set()
    for member in _descendants({pid: ""}):
        found |= {(str(x.address), x.port) for x in listeners(member).values()}
    return found


def _ports(cluster: SimpleNamespace) -> list[dict]:
    """Every listening socket of the cluster's processes, named from the etcd records where they name it."""
    with Registry(cluster.etcd.endpoint, "local", auth=cluster.auth) as registry:
        records = registry.list()
    named = {cluster.etcd.endpoint: ("etcd", "etcd client (HTTPS + gRPC)"),
             f"{cluster.net.hub}:{cluster.etcd.peer_port}": ("etcd-peer", "etcd peer (HTTPS)"),
             cluster.gateway: ("rest", "REST API (HTTPS, API keys)")}  # fmt: skip
    for (role, _), record in records.items():
        public = " public: TLS, API key" if role == "conductor" else " mutual TLS"
        named[record.address] = ("grpc", f"gRPC ({role};{public})")
        if record.metrics_address:
            named[record.metrics_address] = ("metrics", "HTTPS /metrics (a cluster certificate), /health")
        if isinstance(record, WorkerRecord) and record.transfer_endpoint:
            named[record.transfer_endpoint] = ("tcp", "Mooncake TE handshake (in its record)")
    pids = {**{i: p.pid for i, p in cluster.processes.children.items()}, "etcd": cluster.etcd.pid}
    ports = []
    for process, pid in pids.items():
        for address, port in sorted(listening(pid)):
            endpoint = f"{address}:{port}"
            kind, protocol = named.pop(endpoint, (None, ""))
            if kind is None:  # what no record names: in a worker, the transfer engine's data port
                worker = process.startswith(("prefill", "decode"))
                kind, protocol = "tcp", ("Mooncake TE data (in no record)" if worker else "UNNAMED")
            ports.append({"address": endpoint, "process": process, "kind": kind, "protocol": protocol,
                          "host": cluster.hosts[process], "ip": address})  # fmt: skip
    assert not named, f"records name ports that nobody listens on: {named}"
    return ports


def _probe(cluster: SimpleNamespace, name: str, identity: dict, targets: list[dict], netns: str | None) -> dict:
    """tests/trust_probe.py as ``identity`` against ``targets``, run in ``netns`` (None: on the hub)."""
    request = cluster.scratch / f"probe-{name}.json"
    request.write_text(json.dumps({"identity": identity, "targets": targets}))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'protos'}:{ROOT}"}
    command = [sys.executable, str(ROOT / "tests" / "trust_probe.py"), str(request)]
    done = subprocess.run(
        ["ip", "netns", "exec", netns, *command] if netns else command,
        capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, f"the probe failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return dict(json.loads(done.stdout))


def _grpc_expected(served: set[str], public: bool, certificate: bool, method: str) -> set[str]:
    """The codes the trust model allows ``method`` to answer on a port serving ``served``."""
    service = method.rsplit("/", 1)[0].lstrip("/")
    open_to_any = allowed(method) is ANY_CERTIFICATE
    if not public and not certificate:
        return {"UNAVAILABLE"}  # no handshake without a certificate the CA signed
    if service not in served:
        return {"UNIMPLEMENTED"}
    if open_to_any:
        return {"OK"}
    if public:  # the key is the credential there; the test holds none
        return {"UNAUTHENTICATED"}
    if "gateway" in allowed(method):
        return {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "UNAUTHENTICATED"}
    return {"PERMISSION_DENIED"}


def _summary(codes: dict[str, dict]) -> str:
    counts = collections.Counter(result["code"] for result in codes.values())
    return ", ".join(f"{code} x{n}" for code, n in sorted(counts.items()))


def _check_grpc(port: dict, results: dict[str, dict], served: set[str], failures: list[str]) -> dict[str, str]:
    public = "public" in port["protocol"]
    cells = {}
    for who, certificate in (("outsider", False), ("gateway", True)):
        result = results[who][port["address"]]
        plaintext = result["plaintext"]["code"]
        if result["tls"].endswith("bytes") != (public or certificate):  # HTTP/2 spoken only past the credential
            failures.append(f"{port['address']} ({port['process']}) as {who}: TLS {result['tls']}")
        if plaintext != "UNAVAILABLE":
            failures.append(f"{port['address']} ({port['process']}) as {who}: plaintext answered {plaintext}")
        for method, answer in result["methods"].items():
            want = _grpc_expected(served, public, certificate, method)
            if answer["code"] not in want:
                failures.append(f"{port['address']} ({port['process']}) as {who}: {method} answered "
                                f"{answer['code']} ({answer['details']}), expected {sorted(want)}")  # fmt: skip
        cells[who] = f"plaintext {plaintext}; TLS {result['tls']}; {len(result['methods'])} methods: " + _summary(
            result["methods"]
        )
    return cells


def _check_rest(port: dict, results: dict[str, dict], failures: list[str]) -> dict[str, str]:
    cells = {}
    for who in ("outsider", "gateway"):
        answers = results[who][port["address"]]
        for call, answer in answers.items():
            if call.startswith("plaintext"):
                if answer["status"] is not None:
                    failures.append(f"{port['address']} as {who}: {call} answered HTTP {answer['status']}")
            elif call in OPEN_ROUTES:
                if answer["status"] not in (200, 503):
                    failures.append(f"{port['address']} as {who}: {call} answered {answer}")
            elif answer["status"] != 401:
                failures.append(f"{port['address']} as {who}: {call} without a key answered {answer}")
        cells[who] = ", ".join(f"{call} {a['status'] or a.get('error', '')[:40]}" for call, a in answers.items())
    return cells


def _check_etcd(port: dict, results: dict[str, dict], failures: list[str], findings: list[str]) -> dict[str, str]:
    cells = {}
    for who in ("outsider", "gateway"):
        answers = results[who][port["address"]]
        if who == "outsider":
            if answers["plaintext GET /version"]["status"] is not None or answers["GET /version"]["status"] is not None:
                failures.append(f"{port['address']} ({port['kind']}) answered without a client certificate: {answers}")
            if not answers["tls"].startswith("refused"):
                failures.append(
                    f"{port['address']} ({port['kind']}): TLS without a client certificate: {answers['tls']}"
                )
        elif "write /trust-probe/" in answers and answers["write /trust-probe/"]["status"] == 200:
            failures.append(f"{port['address']}: the gateway's certificate wrote a key in etcd")
        elif port["kind"] == "etcd-peer" and not answers["tls"].startswith("refused"):
            findings.append(f"{port['address']} ({port['protocol']}) takes the TLS handshake of the gateway's "
                            f"certificate: {answers['tls']}, GET /version {answers['GET /version']} (etcd checks the "
                            "CA and that a peer's certificate names the caller's address, never the role)")  # fmt: skip
        cells[who] = "; ".join(
            f"{call} {a if isinstance(a, str) else a['status'] or a.get('error', '')[:60]}"
            for call, a in answers.items()
        )
    return cells


def _check_metrics(port: dict, results: dict[str, dict], failures: list[str]) -> dict[str, str]:
    """HTTPS; /health open to anyone (the kubelet's probes), /metrics to a cluster certificate (Prometheus)."""
    cells = {}
    for who, metrics in (("outsider", 401), ("gateway", 200)):
        answers = results[who][port["address"]]
        got = {call: answer["status"] for call, answer in answers.items()}
        want = {"GET /health": 200, "GET /metrics": metrics, "plaintext GET /metrics": None}
        if got != want:
            failures.append(f"{port['address']} ({port['process']}) as {who}: {answers}, expected {want}")
        cells[who] = ", ".join(f"{call} {a['status'] or a.get('error', '')[:40]}" for call, a in answers.items())
    return cells


def _check_tcp(port: dict, results: dict[str, dict], failures: list[str], findings: list[str]) -> dict[str, str]:
    """The transfer engine's ports have no credential: what a TCP connect from host X gets is reported."""
    cells = {who: "; ".join(f"{k} {v}" for k, v in results[who][port["address"]].items()) for who in results}
    outcome = results["outsider"][port["address"]]["connect"]
    findings.append(f"{port['address']} ({port['process']}) {port['protocol']}: listens on its host "
                    f"{port['host']} only; TCP from another host {outcome}: no credential; network policy")  # fmt: skip
    if port["protocol"] == "UNNAMED":
        failures.append(f"{port['address']} ({port['process']}) listens on a port no record names: {cells}")
    return cells


def _table(rows: list[dict]) -> str:
    columns = (
        "port",
        "process",
        "protocol",
        "as outsider (host X; no certificate, no key)",
        "as gateway (its host, its certificate, no key)",
    )
    keys = ("address", "process", "protocol", "outsider", "gateway")
    widths = [max(len(c), *(min(len(str(r[k])), 90) for r in rows)) for c, k in zip(columns, keys, strict=True)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), "-+-".join("-" * w for w in widths)]
    for row in rows:
        cells = [str(row[k]) for k in keys]
        wrapped = [
            [cell[i : i + w] for i in range(0, max(len(cell), 1), w)] for cell, w in zip(cells, widths, strict=True)
        ]
        for line in range(max(len(w) for w in wrapped)):
            lines.append(" | ".join((w[line] if line < len(w) else "").ljust(width)
                                    for w, width in zip(wrapped, widths, strict=True)))  # fmt: skip
    return "\n".join(lines)


def test_in_etcd_each_certificate_writes_only_its_own_roles_records(cluster):
    """Over etcd's gRPC API, as the processes use it: a compromised gateway cannot register a worker."""
    prefix = "/kvconductor/local/instances/"
    host, _, port = cluster.etcd.endpoint.rpartition(":")
    for role, key, allowed_to in (("gateway", "prefill/fake", False), ("gateway", "conductor/fake", False),
                                  ("admin", "decode/fake", False), ("prefill", "decode/fake", False),
                                  ("prefill", "prefill/probe", True)):  # fmt: skip
        auth = EtcdAuth(*(str(cluster.pki / f) for f in ("ca.pem", f"{role}.pem", f"{role}.key")))
        client = connect([(host, int(port))], 10.0, auth)
        try:
            assert len(client.get_prefix_response(prefix).kvs) >= 4  # every role reads the records
            if allowed_to:
                client.put(prefix + key, "{}")
                client.delete(prefix + key)
            else:
                with pytest.raises(Exception, match="permission denied"):
                    client.put(prefix + key, "{}")
        finally:
            client.close()


def test_every_port_of_every_process_refuses_an_outsider_and_the_gateway_gets_only_its_methods(cluster):
    started = time.monotonic()
    ports = _ports(cluster)
    failures: list[str] = []
    findings: list[str] = []
    for port in ports:  # nothing on a wildcard; everything on the process's host, or loopback
        ip = ipaddress.ip_address(port["ip"])
        if ip.is_unspecified or (not ip.is_loopback and port["ip"] != port["host"]):
            failures.append(f"{port['address']} ({port['process']}, {port['protocol']}) listens beyond its host "
                            f"{port['host']}")  # fmt: skip
    reachable = [p for p in ports if not ipaddress.ip_address(p["ip"]).is_loopback]
    targets = [{"address": p["address"].replace("0.0.0.0", p["host"]), "kind": p["kind"]} for p in reachable]
    ca = str(cluster.pki / "ca.pem")
    gateway = {"ca": ca, "cert": str(cluster.pki / "gateway.pem"), "key": str(cluster.pki / "gateway.key")}
    results = {  # the outsider on host X; the gateway's certificate where the gateway runs (a compromised gateway)
        "outsider": _probe(cluster, "outsider", {"ca": ca, "cert": None, "key": None}, targets,
                           cluster.net.hosts["x"]["ns"]),
        "gateway": _probe(cluster, "gateway", gateway, targets, None),
    }  # fmt: skip
    rows, methods = [], []
    for port in ports:
        row = dict(port)
        if port not in reachable:
            row.update(outsider="loopback only: not reachable from another host", gateway="-")
        elif port["kind"] == "grpc":
            reflection = results["gateway"][port["address"]]["methods"]
            served = set(
                reflection["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"].get("services", [])
            )
            row.update(_check_grpc(port, results, served, failures))
            outsider = results["outsider"][port["address"]]["methods"]
            methods += [(port["address"], port["process"], method, outsider[method]["code"], answer["code"])
                        for method, answer in reflection.items()]  # fmt: skip
        elif port["kind"] == "rest":
            row.update(_check_rest(port, results, failures))
        elif port["kind"] in ("etcd", "etcd-peer"):
            row.update(_check_etcd(port, results, failures, findings))
        elif port["kind"] == "metrics":
            row.update(_check_metrics(port, results, failures))
        else:
            row.update(_check_tcp(port, results, failures, findings))
        rows.append(row)
    method_table = "\n".join(f"  {a:<22} {p:<12} {m:<62} outsider {o:<17} gateway {g}" for a, p, m, o, g in methods)
    report = (f"{_table(rows)}\n\nevery gRPC method, per port:\n{method_table}\n\nfindings (not failed):\n"
              + "\n".join(f"  - {f}" for f in findings)
              + f"\n\n{len(ports)} listening sockets, {len(methods)} gRPC calls per identity, "
              f"probed in {time.monotonic() - started:.1f} s")  # fmt: skip
    print("\n" + report)
    assert not failures, "\n".join(failures) + "\n\n" + report


def test_still_serves_exactly_after_the_probes(cluster):
    cluster.processes.check_alive()  # bytes thrown at the transfer engine's ports crashed no worker
    _serves_exactly(cluster, 8, 2)
