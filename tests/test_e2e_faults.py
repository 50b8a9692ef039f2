"""A small cluster without KV copies: routing to the prefix holder, and surviving a worker killed with SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from helpers import MAX_TOKENS, grpc_generate, kvmeta_matches, launch_cluster, stop_cluster

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import conductor_pb2
from services.registry import Registry

pytestmark = pytest.mark.e2e
PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory, model_dir):
    c = launch_cluster(
        tmp_path_factory.mktemp("faults") / "run", model_dir, "prefill.node_count=2", "decode.node_count=1",
        "scheduler.kv_cache_balancing_threshold=inf",
    )  # fmt: skip
    try:
        yield c
    finally:
        stop_cluster(c.process)


def test_idle_workers_send_a_shared_prefix_to_its_holder(small_cluster):
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(320)]
    _, first, _ = grpc_generate(small_cluster, prefix + [1, 2, 3], PD)
    for suffix in ([4, 5, 6, 7], [8, 9]):
        _, decision, usage = grpc_generate(small_cluster, prefix + suffix, PD)
        assert decision.prefill_instance == first.prefill_instance
        assert (decision.copy_from, usage.cached_tokens) == ("", 320)


def test_kill_9_prefill_worker(small_cluster):
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(200)]
    _, decision, _ = grpc_generate(small_cluster, prompt, PD)
    victim = decision.prefill_instance
    hashes = prefix_block_hashes(prompt, 16)
    assert kvmeta_matches(small_cluster, hashes)[victim] == len(hashes)
    os.kill(small_cluster.pid(victim), signal.SIGKILL)
    killed_at = time.monotonic()
    with Registry(small_cluster.manifest["etcd"], small_cluster.manifest["cluster"]) as registry:
        while ("prefill", victim) in registry.list("prefill"):
            assert time.monotonic() - killed_at < 2 + 1 + 0.5, "the lease outlived its TTL + 1 s"
            time.sleep(0.1)
    deadline = time.monotonic() + 5
    while victim in kvmeta_matches(small_cluster, hashes):
        assert time.monotonic() < deadline, "kvmeta kept the dead instance's blocks"
        time.sleep(0.1)
    time.sleep(0.5)  # the Conductor's watch sees the same delete
    for n in (5, 50, 300):
        tokens, decision, _ = grpc_generate(small_cluster, [rng.randrange(256) for _ in range(n)], PD)
        assert len(tokens) == MAX_TOKENS
        assert decision.prefill_instance != victim
