"""The Mooncake Store tier on vLLM workers: 1 prefill + 1 decode worker (vLLM, fp32) and the store service.

The prefill worker runs vLLM's MooncakeStoreConnector beside its MooncakeConnector (``StoreTierConnector``):
every prompt's full blocks go into the Store, whose KV events kvmeta indexes as the Store's blocks, and a
prompt whose prefix the pool lost is loaded from the Store instead of recomputed. The prefill pool is about
the least vLLM takes (one 4,096-token request of the test model, 4 KiB a token): two long prompts evict a third.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import (
    FAR_SLOS,
    grpc_generate,
    kvmeta_matches,
    listeners_off,
    run_load,
    running_cluster,
    store_master_pid,
)

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc

pytestmark = pytest.mark.vllm
PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
BLOCK = 32
POOL_MB = 17  # 4,352 tokens: vLLM refuses a pool that cannot hold one max_model_len (4,096) request
EVICTING_PROMPT = 2300  # two of them fill the pool


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    with running_cluster(
        tmp_path_factory.mktemp("vllm-store") / "run", model_dir, 'engine.backend="vllm"',
        "prefill.node_count=1", "decode.node_count=1", "colocated.node_count=0",
        *(f"{pool}.prefix_cache_block_size={BLOCK}" for pool in ("prefill", "decode", "colocated")),
        f"prefill.kv_cache_memory_mb={POOL_MB}", "store.enabled=true",
        "store.segment_mb=64",  # the Store keeps the prompt while the evicting prompts go in too
        # Copies follow Algorithm 1's threshold alone: this is about the Store's path, not the copy-or-recompute call.
        "scheduler.compare_copy_with_recompute=false", *FAR_SLOS,
        "cluster.lease_ttl_s=10",  # beside a CPU hog a 6 s lease of the store service lapsed: kvmeta dropped its index
    ) as c:  # fmt: skip
        yield c


def _wait_for(cluster, hashes, holder, want, timeout=120):
    """Poll kvmeta until ``holder`` matches ``want`` leading blocks of ``hashes`` (events lag the steps)."""
    deadline = time.monotonic() + timeout
    while (got := kvmeta_matches(cluster, hashes).get(holder, 0)) != want:
        assert time.monotonic() < deadline, f"{holder} holds {got} of the prompt's blocks, not {want}"
        time.sleep(0.2)


def test_vllms_store_client_listens_on_the_cluster_host_only(cluster):
    """Its transfer engine inside vLLM's model runner included (``bind_guard``, installed by vllm_connector)."""
    assert listeners_off(cluster) == []


def test_a_prefix_the_vllm_holder_evicted_is_loaded_from_the_store(cluster):
    rng = random.Random(31)
    prompt = [rng.randrange(256) for _ in range(600)]
    hashes = prefix_block_hashes(prompt, BLOCK)
    cold, first, usage = grpc_generate(cluster, prompt, PD)
    assert usage.cached_tokens == 0
    holder = first.prefill_instance
    _wait_for(cluster, hashes, "store-0", len(hashes))  # the Store connector's puts, indexed from vLLM's events
    for _ in range(2):
        grpc_generate(cluster, [rng.randrange(256) for _ in range(EVICTING_PROMPT)], PD, max_tokens=1)
    _wait_for(cluster, hashes, holder, 0)  # gone from vLLM's pool

    tokens, decision, usage = grpc_generate(cluster, prompt, PD, request_id="from-the-store")
    reusable = (len(prompt) - 1) // BLOCK * BLOCK
    assert (decision.copy_from, decision.prefix_len) == ("store-0", reusable), decision.reason
    assert "the Mooncake Store (store-0)" in decision.reason
    assert usage.cached_tokens == reusable  # vLLM's own count: its connector loaded the blocks from the Store
    assert tokens == cold  # what computing the prompt gave
    with grpc.insecure_channel(cluster.conductor) as channel:
        explained = conductor_pb2_grpc.ConductorStub(channel).ExplainDecision(
            conductor_pb2.ExplainDecisionRequest(request_id="from-the-store"), timeout=10
        )
    assert explained.outcome.copied_tokens == reusable, explained.outcome
    assert "loaded by vLLM's Store connector" in explained.outcome.copy_note


def test_a_master_killed_under_load_fails_no_vllm_request(cluster):
    """vLLM's Store client looks every prompt up and puts every prompt's blocks: a dead master must cost time only.

    What vLLM's client does once the store service has started the master again is not asserted: unlike the
    built-in path's client (tests/e2e/test_store.py) it is never re-created, and runs differed (docs/vllm.md).
    """
    rng = random.Random(32)
    shared = [[rng.randrange(256) for _ in range(256)] for _ in range(3)]
    prompts = [shared[i % 3] + [rng.randrange(256) for _ in range(48)] for i in range(6)]
    reference = run_load(cluster, prompts[:3], threads=1)  # each shared prefix computed once, before the kill
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_load, cluster, prompts, 2)
        time.sleep(1.0)  # the first requests are in flight, their blocks on their way into the Store
        os.kill(store_master_pid(cluster), signal.SIGKILL)
        results = load.result(timeout=600)
    failed = [r for r in results if not isinstance(r, list)]
    assert not failed, failed
    assert results[:3] == reference
