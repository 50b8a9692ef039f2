"""The Mooncake Store as the second KV tier, on a live cluster (issue 14).

A cluster with ``[store] enabled``: the store service runs a real ``mooncake_master``, the prefill worker
writes every prompt's blocks through to the Store and reads them back by block hash, and the Conductor
plans copies from the Store like copies from a peer.
"""

from __future__ import annotations

import random
import time

import grpc
import helpers
import pytest
from helpers import running_cluster

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc

PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
# 4 MiB of prefill pool: 64 blocks of the test model (64 KiB each), 1,024 tokens: two long prompts evict a third.
# Copies follow Algorithm 1's threshold alone (no veto by the predicted cost): on a starved machine the learned
# links can make a copy look slower than recomputing, and these tests are about the Store's path, not that choice.
POOL = ("prefill.node_count=1", "decode.node_count=1", "prefill.kv_cache_memory_mb=4", "store.enabled=true",
        "store.segment_mb=16", "scheduler.compare_copy_with_recompute=false")  # fmt: skip


@pytest.fixture(scope="module")
def store_cluster(tmp_path_factory, model_dir):
    with running_cluster(tmp_path_factory.mktemp("store") / "run", model_dir, *POOL) as c:
        yield c


def _wait_for(cluster, hashes, holder, want, timeout=60):
    """Poll kvmeta until ``holder`` matches ``want`` leading blocks of ``hashes`` (events lag the steps)."""
    deadline = time.monotonic() + timeout
    while (got := helpers.kvmeta_matches(cluster, hashes).get(holder, 0)) != want:
        assert time.monotonic() < deadline, f"{holder} holds {got} of the prompt's blocks, not {want}"
        time.sleep(0.2)


def _only_in_store(cluster, rng, length=600):
    """A prompt served once (its greedy tokens, ``cold``), now in the Store and in no engine pool."""
    prompt = [rng.randrange(256) for _ in range(length)]
    hashes = prefix_block_hashes(prompt, 16)
    cold, first, usage = helpers.grpc_generate(cluster, prompt, PD)
    assert usage.cached_tokens == 0
    _wait_for(cluster, hashes, "store-0", len(hashes))  # written through to the Store and indexed there
    for _ in range(2):  # two other long prompts push it out of the prefill worker's 64 blocks
        helpers.grpc_generate(cluster, [rng.randrange(256) for _ in range(900)], PD, max_tokens=1)
    _wait_for(cluster, hashes, first.prefill_instance, 0)
    _wait_unpinned(cluster, first.prefill_instance)
    return prompt, hashes, cold


def _wait_unpinned(cluster, instance_id, timeout=90):
    """Wait until the worker's write-throughs are done: every block free or evictable again, none pinned.

    A write-through pins the prompt's blocks while the Store reads them; one caught by a hanging master keeps
    them until Mooncake gives up (60 s), which would starve the 64-block pool of the tests' next prompt.
    """
    deadline = time.monotonic() + timeout
    while (load := helpers.worker_loads(cluster)[instance_id]).num_free_blocks < load.num_total_blocks:
        assert time.monotonic() < deadline, f"{instance_id} still holds {load.num_total_blocks - load.num_free_blocks}"
        time.sleep(0.1)


def _outcome(cluster, request_id):
    with grpc.insecure_channel(cluster.conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        return stub.ExplainDecision(conductor_pb2.ExplainDecisionRequest(request_id=request_id), timeout=10).outcome


def test_a_prefix_evicted_from_every_pool_is_served_from_the_store(store_cluster, model_dir):
    prompt, _, cold = _only_in_store(store_cluster, random.Random(14))
    tokens, decision, usage = helpers.grpc_generate(store_cluster, prompt, PD)
    assert (decision.copy_from, decision.prefix_len) == ("store-0", 592), decision.reason
    assert "the Mooncake Store (store-0)" in decision.reason
    assert usage.cached_tokens == 592
    assert tokens == cold == helpers.reference_tokens(model_dir, [prompt])[0]
    status = helpers.cli(store_cluster, "status")
    assert f"Mooncake Store: store-0, master {helpers.store_record(store_cluster).master_address}" in status.stdout
    assert "store-0 -> prefill-0: " in status.stdout, status.stdout  # the link learned from the Store's reads


def _raw_client(cluster):
    """A Mooncake Store client of the test's own, on the cluster's master."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "",
                        helpers.store_record(cluster).master_address) == 0  # fmt: skip
    return client


def test_blocks_gone_from_the_store_between_match_and_read_are_recomputed(store_cluster, model_dir):
    prompt, hashes, cold = _only_in_store(store_cluster, random.Random(15))
    assert _raw_client(store_cluster).remove_all(True) >= len(hashes)  # kvmeta still lists them in store-0

    tokens, decision, usage = helpers.grpc_generate(store_cluster, prompt, PD, request_id="gone-1")
    assert decision.copy_from == "store-0", decision.reason  # planned on kvmeta's (stale) word
    assert usage.cached_tokens == 0
    assert tokens == cold
    assert "store-0: the Store had 0 of 37 blocks" in _outcome(store_cluster, "gone-1").copy_note
    _wait_for(store_cluster, hashes, "store-0", len(hashes))  # computed again, and written through again


def test_a_store_read_that_hangs_is_given_up_and_the_prompt_recomputed(store_cluster, model_dir):
    import os
    import signal

    # 320 tokens: the 19 blocks the hanging read holds (until Mooncake gives up, 30 s) leave room in the 64-block
    # pool for the 21 the prompt is recomputed in
    prompt, _, cold = _only_in_store(store_cluster, random.Random(16), length=320)
    master = helpers.store_master_pid(store_cluster)
    os.kill(master, signal.SIGSTOP)  # alive (its service does not restart it) but silent: Mooncake waits 30 s
    try:
        tokens, decision, usage = helpers.grpc_generate(store_cluster, prompt, PD, request_id="hang-1")
    finally:
        os.kill(master, signal.SIGCONT)
    assert decision.copy_from == "store-0", decision.reason
    assert usage.cached_tokens == 0
    assert tokens == cold
    explained = helpers.cli(store_cluster, "explain", "hang-1")
    assert "the planned copy moved less: store-0: no answer within 1.0 s; recomputing" in explained.stdout


def test_a_master_killed_under_load_fails_no_request_and_the_store_caches_again(store_cluster, model_dir):
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(41)
    shared = [[rng.randrange(256) for _ in range(256)] for _ in range(3)]
    prompts = [shared[i % 3] + [rng.randrange(256) for _ in range(48)] for i in range(12)]
    before = helpers.store_record(store_cluster)
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(helpers.run_load, store_cluster, prompts, 2)
        time.sleep(1.0)  # the first requests are in flight, their blocks on their way into the Store
        os.kill(helpers.store_master_pid(store_cluster), signal.SIGKILL)
        results = load.result(timeout=300)
    failed = [r for r in results if not isinstance(r, list)]
    assert not failed, failed
    assert results == helpers.reference_tokens(model_dir, prompts)

    deadline = time.monotonic() + 60  # the store service started the master again: a new generation
    while (after := helpers.store_record(store_cluster)).generation == before.generation:
        assert time.monotonic() < deadline, "the master was not restarted"
        time.sleep(0.2)
    assert after.master_address == before.master_address
    deadline = time.monotonic() + 60  # new prefixes are cached again (a worker may still be reconnecting at first)
    while True:
        fresh = [rng.randrange(256) for _ in range(320)]
        helpers.grpc_generate(store_cluster, fresh, PD, max_tokens=1)
        try:
            _wait_for(store_cluster, prefix_block_hashes(fresh, 16), "store-0", 20, timeout=10)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "no new prefix reached the restarted Store"


def test_a_store_service_whose_lease_lapsed_comes_back_to_the_same_index(store_cluster):
    """The store service stalls past its etcd lease (its master runs on): kvmeta keeps the Store's entries."""
    import os
    import signal

    prompt, hashes, cold = _only_in_store(store_cluster, random.Random(17))
    before = helpers.store_record(store_cluster)
    service = store_cluster.manifest["processes"]["store-0"]["pid"]
    os.kill(service, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while helpers.store_record(store_cluster) is not None:
            assert time.monotonic() < deadline, "the stopped store service's lease did not lapse"
            time.sleep(0.2)
    finally:
        os.kill(service, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while (after := helpers.store_record(store_cluster)) is None:
        assert time.monotonic() < deadline, "the store service did not register again"
        time.sleep(0.2)
    assert after.generation == before.generation  # the same master
    assert helpers.kvmeta_matches(store_cluster, hashes).get("store-0") == len(hashes)  # its index kept
    deadline = time.monotonic() + 30  # the Conductor sees the record again through its own etcd watch
    while not helpers.conductor_status(store_cluster).store_json:
        assert time.monotonic() < deadline, "the Conductor did not see the store service again"
        time.sleep(0.2)
    tokens, decision, _ = helpers.grpc_generate(store_cluster, prompt, PD)
    assert decision.copy_from == "store-0", decision.reason
    assert tokens == cold


def test_the_store_and_its_master_listen_on_the_cluster_host_only(store_cluster):
    """mooncake_master (a child of the store service) and every client's transfer engine included."""
    assert helpers.listeners_off(store_cluster) == []
