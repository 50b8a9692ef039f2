"""A worker killed with SIGKILL: its registration and its KV index entries go, the cluster keeps serving."""

from __future__ import annotations

import os
import random
import signal
import time

import grpc
import pytest
from helpers import grpc_generate, launch_cluster, stop_cluster

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import kvmeta_pb2, kvmeta_pb2_grpc
from services.registry import Registry

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory, model_dir):
    c = launch_cluster(tmp_path_factory.mktemp("faults") / "run", model_dir, "prefill.node_count=2",
                       "decode.node_count=1")  # fmt: skip
    try:
        yield c
    finally:
        stop_cluster(c.process)


def kvmeta_matches(registry, hashes):
    address = next(iter(registry.list("kvmeta").values()))["address"]
    with grpc.insecure_channel(address) as channel:
        reply = kvmeta_pb2_grpc.KvMetaStub(channel).MatchPrefix(kvmeta_pb2.MatchPrefixRequest(block_hashes=hashes))
    return {m.instance_id: m.prefix_blocks for m in reply.matches}


def test_kill_9_prefill_worker(small_cluster):
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(200)]
    _, decision, _ = grpc_generate(small_cluster, prompt, 1)
    victim = decision.prefill_instance
    hashes = prefix_block_hashes(prompt, 16)
    registry = Registry(small_cluster.manifest["etcd"], small_cluster.manifest["cluster"], ttl=2)
    try:
        assert kvmeta_matches(registry, hashes)[victim] == len(hashes)
        os.kill(small_cluster.pid(victim), signal.SIGKILL)
        killed_at = time.monotonic()
        while ("prefill", victim) in registry.list("prefill"):
            assert time.monotonic() - killed_at < 2 + 1 + 0.5, "the lease outlived its TTL + 1 s"
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while victim in kvmeta_matches(registry, hashes):
            assert time.monotonic() < deadline, "kvmeta kept the dead instance's blocks"
            time.sleep(0.1)
    finally:
        registry.close()
    time.sleep(0.5)  # the Conductor's watch sees the same delete
    for n in (5, 50, 300):
        tokens, decision, _ = grpc_generate(small_cluster, [rng.randrange(256) for _ in range(n)], 1)
        assert len(tokens) == 12
        assert decision.prefill_instance != victim
