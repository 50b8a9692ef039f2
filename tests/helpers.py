"""Helpers for end-to-end tests: launch `kvconductor up`, call the Conductor, read worker counters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx

from cli import local_cluster
from cli.local_cluster import LocalCluster
from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.instance_record import InstanceRecord, WorkerRecord
from services.common.registry import Registry

MAX_TOKENS = 12


# SLOs far beyond any latency here, for tests about behaviour: a busy machine must not turn a long prompt
# into an admission rejection (admission has its own tests and clusters).
FAR_SLOS = (
    "prefill.max_ttft_ms=60000", "colocated.max_ttft_ms=60000", "decode.max_tbt_ms=10000", "colocated.max_tbt_ms=10000",
)  # fmt: skip

TEST_OVERRIDES = (
    "prefill.kv_cache_memory_mb=64", "decode.kv_cache_memory_mb=64", "colocated.kv_cache_memory_mb=64",
    "cluster.lease_ttl_s=2",
    'engine.profile_cache_dir=""',  # every test cluster profiles its engines (tests/e2e/test_profile_reuse.py keeps)
)  # fmt: skip


def launch_cluster(run_dir: Path, model: Path, *overrides: str) -> LocalCluster:
    """A cluster of the test model on free loopback ports, with small KV pools and short leases."""
    model_args = [f'model.path="{model}"', 'model.name="tiny-llama"', 'model.source=""']
    return local_cluster.start("deploy/config.toml", [*model_args, *TEST_OVERRIDES, *overrides], run_dir)


def stop_cluster(process: subprocess.Popen[bytes]) -> None:
    """Stop a launched cluster."""
    local_cluster.stop(process)


@contextmanager
def running_cluster(run_dir: Path, model: Path, *overrides: str) -> Iterator[LocalCluster]:
    """``launch_cluster``, stopped when the block ends (also on errors)."""
    c = launch_cluster(run_dir, model, *overrides)
    try:
        yield c
    finally:
        stop_cluster(c.process)


def grpc_generate(cluster, prompt_ids, deployment, max_tokens=MAX_TOKENS, request_id=""):
    """Token ids, the decision and the usage of one greedy request through the Conductor."""
    request = conductor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=conductor_pb2.TokenIds(ids=prompt_ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        deployment=deployment,
        include_decision=True,
    )
    tokens, decision, usage = [], None, None
    with grpc.insecure_channel(cluster.conductor) as channel:
        for message in conductor_pb2_grpc.ConductorStub(channel).Generate(request, timeout=120):
            tokens += message.token_ids
            decision = decision or (message.decision if message.HasField("decision") else None)
            usage = message.usage if message.HasField("usage") else usage
    return tokens, decision, usage


def streamed_completion(rest: str, prompt: list[int], max_tokens: int, streaming=None, timeout: float = 120.0):
    """A greedy streamed completion of ``max_tokens`` through the gateway's REST API at ``rest``: its text, or the
    exception or HTTP error that ended it. ``streaming`` (a threading.Event) is set once text arrives."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = ""
    try:
        with httpx.stream("POST", f"{rest}/completions", json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                return RuntimeError(f"HTTP {reply.status_code}: {reply.read().decode()}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = httpx.Response(200, content=line.removeprefix("data: ")).json()
                if "error" in chunk:
                    return RuntimeError(str(chunk["error"]))
                text += chunk["choices"][0]["text"]
                if streaming is not None and text:
                    streaming.set()
    except httpx.HTTPError as e:
        return e
    return text


def make_pki(directory: Path, common_name: str, subject_alt_names: str, roles: Sequence[str] = ()) -> Path:
    """A test CA (``ca.pem``, ``ca.key``) and certificates signed by it for ``subject_alt_names`` (openssl's
    syntax: ``IP:127.0.0.1,DNS:localhost``), good for serving and as a client: ``node.pem``/``node.key``
    naming no role, and ``ROLE.pem``/``ROLE.key`` naming each of ``roles`` (services/common/access.py; CN=ROLE,
    the etcd user of cli/etcd_roles.py)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    def issue(name: str, sans: str, cn: str = common_name) -> None:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={cn}")  # fmt: skip
        (directory / "ext.cnf").write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=kvconductor test CA")  # fmt: skip
    issue("node", subject_alt_names)
    for role in roles:
        issue(role, f"URI:spiffe://kvconductor/{role},{subject_alt_names}", cn=role)  # etcd's user: the CN
    return directory


def cli(cluster, *args):
    """``kvconductor ARGS`` against the cluster's Conductor (the finished process)."""
    command = [sys.executable, "-m", "cli.main", *args, "--set", f'cluster.scheduler_endpoint="{cluster.conductor}"']
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def kill_decode_worker_mid_stream(cluster, prompt_ids, max_tokens, after_tokens, timeout=120):
    """Stream one greedy PD request and kill -9 its decode worker after ``after_tokens`` tokens.

    Returns every streamed token and the killed instance (None if the stream never named one).
    """
    request = conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=prompt_ids), include_decision=True,
        deployment=conductor_pb2.DEPLOYMENT_DISAGGREGATED,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    tokens, victim = [], None
    with grpc.insecure_channel(cluster.conductor) as channel:
        for message in conductor_pb2_grpc.ConductorStub(channel).Generate(request, timeout=timeout):
            tokens += message.token_ids
            if message.HasField("decision"):
                victim = message.decision.decode_instance
            if victim and len(tokens) >= after_tokens and victim in cluster.manifest["processes"]:
                os.kill(cluster.pid(victim), signal.SIGKILL)
                cluster.manifest["processes"].pop(victim)
    return tokens, victim


def _descendants(roots: dict[int, str]) -> dict[int, str]:
    """Every live process below ``roots`` (pid -> name), named after its root."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone since the listing
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = dict(roots), list(roots)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found[child] = found[pid]
            todo.append(child)
    return found


def listeners_off(cluster, host: str = "127.0.0.1") -> list[str]:
    """Every TCP port that a process of the cluster (or a child of one: vLLM's, mooncake_master) listens on
    elsewhere than ``host``, as "instance (pid): address:port"; [] when the whole cluster stays on it."""
    from services.worker.kv.bind_guard import listeners, resolve

    roots = {info["pid"]: instance_id for instance_id, info in cluster.manifest["processes"].items()}
    exposed = []
    for pid, name in _descendants(roots).items():
        try:
            found = listeners(pid)
        except OSError:  # exited since
            continue
        exposed += [f"{name} ({pid}): {x.address}:{x.port}" for x in found.values() if x.address != resolve(host)]
    return exposed


def worker_loads(cluster):
    loads = {}
    for instance_id, info in cluster.manifest["processes"].items():
        if info["role"] not in ("prefill", "decode", "colocated"):
            continue
        with grpc.insecure_channel(address_of(cluster, instance_id)) as channel:
            loads[instance_id] = worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
    return loads


def conductor_status(cluster):
    """The Conductor's ``GetStatus``: instances, learned links, prediction errors."""
    with grpc.insecure_channel(cluster.conductor) as channel:
        return conductor_pb2_grpc.ConductorStub(channel).GetStatus(conductor_pb2.GetStatusRequest(), timeout=10)


def address_of(cluster, instance_id, timeout=60):
    """The instance's gRPC address as the Conductor sees it. On a starved machine etcd itself can stall long
    enough for every lease to lapse: the instance registers again and comes back into view; wait for it."""
    deadline = time.monotonic() + timeout
    while True:
        found = [i.address for i in conductor_status(cluster).instances if i.instance_id == instance_id]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Conductor has not seen {instance_id} for {timeout} s")
        time.sleep(0.2)


def worker_record(cluster, role):
    """The etcd record of the first worker of ``role``, as the Conductor sees it."""
    status = conductor_status(cluster)
    record = InstanceRecord.from_json(json.loads(next(i.record_json for i in status.instances if i.role == role)))
    assert isinstance(record, WorkerRecord)
    return record


def bytes_per_block(cluster, role="decode"):
    return worker_record(cluster, role).kv_layout.bytes_per_block


def records(cluster) -> dict[tuple[str, str], InstanceRecord]:
    """Every record in the cluster's etcd, by (role, instance id)."""
    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        return registry.list()


def scrape(address: str) -> dict[str, float]:
    """Prometheus samples of a /metrics endpoint by 'name{labels}'."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def kvmeta_matches(cluster, block_hashes, timeout=30):
    """kvmeta's prefix match per instance, in blocks.

    Retries while no kvmeta is registered or answers: on a busy machine a lease can expire and come back.
    """
    from kvconductor.v1 import kvmeta_pb2, kvmeta_pb2_grpc
    from services.common.registry import Registry

    deadline = time.monotonic() + timeout
    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        while time.monotonic() < deadline:
            addresses = [record.address for record in registry.list("kvmeta").values()]
            for address in reversed(addresses):  # the newest first: an old kvmeta may be dead but not yet expired
                with grpc.insecure_channel(address) as channel:
                    try:
                        reply = kvmeta_pb2_grpc.KvMetaStub(channel).MatchPrefix(
                            kvmeta_pb2.MatchPrefixRequest(block_hashes=block_hashes), timeout=10
                        )
                    except grpc.RpcError:
                        continue
                return {m.instance_id: m.prefix_blocks for m in reply.matches}
            time.sleep(0.2)
    raise RuntimeError(f"no kvmeta answered for {timeout} s")


def wait_indexed(cluster, prefix, holder, block_size=16, timeout=60):
    """Poll kvmeta until ``holder`` is indexed with every full block of ``prefix`` (KV events lag the steps)."""
    from engine.block_hash import prefix_block_hashes

    hashes, deadline = prefix_block_hashes(prefix, block_size), time.monotonic() + timeout
    while kvmeta_matches(cluster, hashes).get(holder, 0) < len(hashes):
        assert time.monotonic() < deadline, f"kvmeta never indexed the prefix on {holder}"
        time.sleep(0.1)


def prefill_booked_on(cluster, pending, timeout=60):
    """The prefill worker on which the Conductor books the ``pending`` request's prefill (None: it ended first).

    Polls the Conductor's own queue estimate (T_queue), which is what the next request's Algorithm 1 sees.
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(cluster.conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        while not pending.done() and time.monotonic() < deadline:
            status = stub.GetStatus(conductor_pb2.GetStatusRequest(), timeout=10)
            booked = [i.instance_id for i in status.instances if i.role == "prefill" and i.t_queue_ms > 0]
            if booked:
                return booked[0]
            time.sleep(0.02)
    return None


def reference_tokens(model_dir, prompts, max_tokens=MAX_TOKENS):
    """Greedy output of the engine in this process, for comparison with a cluster's."""
    from engine.llm_engine import LLMEngine, generate
    from engine.sampling import SamplingParams

    engine = LLMEngine(model_dir, num_blocks=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [generate(engine, p, params) for p in prompts]


def store_record(cluster):
    """The store service's etcd record (its master's address and start), None while it is not registered."""
    from services.common.registry import Registry

    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        return next(iter(registry.list("store").values()), None)


def store_master_pid(cluster) -> int:
    """The mooncake_master child of the store service."""
    service = cluster.manifest["processes"]["store-0"]["pid"]
    children = Path(f"/proc/{service}/task/{service}/children").read_text().split()
    assert len(children) == 1, f"the store service has children {children}"
    return int(children[0])


def run_load(cluster, prompts, threads=3, max_tokens=MAX_TOKENS):
    """Greedy requests through the Conductor from several threads; token lists or the exception each raised."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt):
        try:
            return grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED, max_tokens=max_tokens)[0]
        except grpc.RpcError as e:
            return e

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, prompts))


def spawn(cluster, role, instance_id, log_dir, extra_args=()):
    """Start one more process of the cluster (`kvconductor serve`), logging to log_dir/<id>.log."""
    log = (Path(log_dir) / f"{instance_id}.log").open("wb")
    args = [sys.executable, "-m", "cli.main", "serve", role, "--id", instance_id, *cluster.manifest["serve_args"],
            *extra_args]  # fmt: skip
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)


def wait_registered(cluster, role, instance_id, present=True, timeout=180, auth=None):
    """Wait until an instance's key is (or is no longer) in etcd (``auth``: an EtcdAuth, for an etcd with TLS).

    A new worker loads its model and profiles it before it registers: about a minute on a busy machine.
    """
    from services.common.registry import Registry

    deadline = time.monotonic() + timeout
    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"], auth=auth) as registry:
        while ((role, instance_id) in registry.list(role)) != present:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{instance_id} {'never registered' if present else 'still registered'}")
            time.sleep(0.2)
