"""The replicated control plane across hosts: one host's links cut under load loses no request.

Three hosts as network namespaces (``tests/netns.py``)::

    root namespace = host A (hub)          netns B = host B             netns C = host C
      etcd, kvmeta-0, conductor-0,   ──veth──  conductor-1, prefill-1,  ──veth──  decode-c, kvmeta-1
      prefill-0, the gateway                   decode-b

The gateway spreads requests over both Conductors (found in etcd); every worker publishes to both kvmeta
replicas. Cutting host B's link mid-load takes a Conductor, a prefill and a decode worker away at once:
the gateway resumes conductor-1's streams at conductor-0 (its keepalive notices the dead connection), and
conductor-0 resumes what it had on prefill-1 or decode-b on the hosts it still reaches (its watchdog and
the lost leases). Every request completes with the greedy text it has without the fault.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from helpers import reference_tokens, streamed_completion
from netns import hosts as netns_hosts
from netns import skip_reason

from engine.tokenizer import load_tokenizer
from services.common.net import free_port

if (_reason := skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

MAX_TOKENS = 40
STALL_S = 4  # the Conductor's watchdog: a worker on the cut host is given up after this long without progress
# keepalive (10 s + 5 s, services/common/rpc.py) for the gateway's streams from conductor-1, then the retry
CUT_BOUND_S = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[SimpleNamespace]:
    scratch = tmp_path_factory.mktemp("netns-replicas")
    with netns_hosts(scratch, "b", "c") as (net, processes, etcd):
        b, c = net.hosts["b"]["address"], net.hosts["c"]["address"]
        gateway_port = free_port()
        common = [
            "--config", "deploy/config.toml", "--set", f'model.path="{model_dir}"', "--set", 'model.name="tiny-llama"',
            "--set", f'cluster.etcd_endpoints=["{etcd.endpoint}"]', "--set", "cluster.lease_ttl_s=2",
            "--set", "cluster.kv_transfer_timeout_s=3", "--set", "prefill.kv_cache_memory_mb=64",
            "--set", "decode.kv_cache_memory_mb=64", "--set", "scheduler.reject_on_slo_violation=false",
            "--set", "cluster.insecure_network=true",  # the namespaces are this test's own network
            "--set", "scheduler.kv_cache_balancing_threshold=inf", "--set", f"scheduler.stall_timeout_s={STALL_S}",
            "--set", f'gateway.host="{net.hub}"', "--set", f"gateway.port={gateway_port}",
            "--set", f'telemetry.trace_dir="{scratch / "traces"}"',
        ]  # fmt: skip

        def on(address: str, conductor_port: int = 0) -> list[str]:
            endpoint = ["--set", f'cluster.scheduler_endpoint="{address}:{conductor_port}"'] if conductor_port else []
            return [*common, "--set", f'cluster.host="{address}"', *endpoint]

        b_ns, c_ns = net.hosts["b"]["ns"], net.hosts["c"]["ns"]
        first = free_port()
        plan = [
            ("kvmeta", "kvmeta-0", on(net.hub), None), ("kvmeta", "kvmeta-1", on(c), c_ns),
            ("conductor", "conductor-0", on(net.hub, first), None),
            ("conductor", "conductor-1", on(b, free_port()), b_ns),
            ("prefill", "prefill-0", on(net.hub), None), ("prefill", "prefill-1", on(b), b_ns),
            ("decode", "decode-b", on(b), b_ns), ("decode", "decode-c", on(c), c_ns),
        ]  # fmt: skip
        for role, instance_id, args, ns in plan:
            processes.start(role, instance_id, args, ns)
        processes.start("gateway", "gateway-0", on(net.hub, first))  # it finds conductor-1 in etcd
        processes.wait_registered(etcd.endpoint, [(role, instance_id) for role, instance_id, _, _ in plan], 240)
        rest = f"http://{net.hub}:{gateway_port}/v1"
        deadline = time.monotonic() + 120
        while httpx.get(rest.removesuffix("/v1") + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never became healthy"
            time.sleep(0.2)
        yield SimpleNamespace(net=net, processes=processes, rest=rest, model_dir=model_dir)


def test_cutting_a_host_with_a_conductor_and_workers_under_load_loses_no_request(cluster):
    rng = random.Random(61)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(40, 300))] for _ in range(12)]
    tokenizer = load_tokenizer(str(cluster.model_dir))
    expected = [tokenizer.decode(t, skip_special_tokens=True)
                for t in reference_tokens(cluster.model_dir, prompts, MAX_TOKENS)]  # fmt: skip
    streaming = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(streamed_completion, cluster.rest, p, MAX_TOKENS, streaming, CUT_BOUND_S + 60) for p in prompts
        ]
        assert streaming.wait(120), "no request streamed"
        cluster.net.cut("b")
        cut_at = time.monotonic()
        results = [f.result() for f in futures]
    elapsed = time.monotonic() - cut_at
    assert results == expected  # no request lost, no gap or repeat in any stream
    assert elapsed < CUT_BOUND_S, f"the last request ended {elapsed:.0f} s after the cut"
    log = cluster.processes.log("gateway-0")
    print(f"all {len(prompts)} requests completed {elapsed:.1f} s after the cut; "
          f"{log.count('going on at')} streams failed over at the gateway")  # fmt: skip
