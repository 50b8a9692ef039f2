"""The vLLM backend on a real cluster: 2 prefill + 2 decode workers and 1 colocated worker, all vLLM (fp32).

The colocated worker is a single vLLM instance: the disaggregated path (KV over vLLM's MooncakeConnector)
must give its greedy tokens exactly. vLLM's KV events reach kvmeta, so Algorithm 1 sees ``prefix_len`` on
the prefill worker that holds a prefix and ``cached_tokens`` is vLLM's own count. Prefill runs in 64-token
chunks (the colocated worker too, so both compute the same KV), which keeps a long prompt on its prefill
worker for many engine steps. The tests run in file order; the last kills a decode worker.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    grpc_generate,
    kill_decode_worker_mid_stream,
    launch_cluster,
    prefill_booked_on,
    stop_cluster,
    wait_indexed,
    worker_loads,
)

from kvconductor.v1 import conductor_pb2

pytestmark = pytest.mark.vllm
PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
COLOCATED = conductor_pb2.DEPLOYMENT_COLOCATED
BLOCK = 32
CHUNK = 64


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory, model_dir):
    c = launch_cluster(
        tmp_path_factory.mktemp("vllm") / "run", model_dir, 'engine.backend="vllm"',
        "prefill.node_count=2", "decode.node_count=2", "colocated.node_count=1",
        *(f"{pool}.prefix_cache_block_size={BLOCK}" for pool in ("prefill", "decode", "colocated")),
        f"prefill.max_num_batched_tokens={CHUNK}", f"colocated.max_num_batched_tokens={CHUNK}",
        "prefill.max_ttft_ms=60000", "decode.max_tbt_ms=10000", "colocated.max_ttft_ms=60000",
        "colocated.max_tbt_ms=10000",
        "cluster.lease_ttl_s=6",  # five vLLM instances starting on two cores can starve etcd's lease keep-alives
    )  # fmt: skip
    try:
        yield c
    finally:
        stop_cluster(c.process)


def _prompts(seed, count, low=40, high=300):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def test_disaggregated_vllm_gives_the_tokens_of_a_single_vllm_instance(vllm_cluster):
    for prompt in _prompts(1, 4):
        single, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED)
        tokens, decision, _ = grpc_generate(vllm_cluster, prompt, PD)
        assert decision.decode_instance.startswith("decode-")
        assert tokens == single and len(tokens) == 12


def test_kvcache_centric_sends_each_repeated_prefix_to_the_prefill_worker_that_holds_it(vllm_cluster):
    prompts = _prompts(2, 7, 900, 901)
    a = prompts[0]
    _, first, _ = grpc_generate(vllm_cluster, a + [1, 2, 3], PD)
    holder_a = first.prefill_instance
    wait_indexed(vllm_cluster, a, holder_a, BLOCK)  # else the long prompt below may not be sent to the holder of A
    # Prefix B goes to the other prefill worker: it is sent while the holder of A prefills a long prompt that
    # starts with A (so Algorithm 1 puts that one on the holder). A lost race (the long prompt already done)
    # places B on the holder again: try again with a fresh B.
    for b, tail in zip(prompts[1:4], prompts[4:7], strict=True):
        with ThreadPoolExecutor(1) as pool:
            long_prompt = pool.submit(grpc_generate, vllm_cluster, a + tail * 3, PD, 2)  # about 3,600 tokens
            assert prefill_booked_on(vllm_cluster, long_prompt) in (holder_a, None), (
                "the long prompt went to the other worker"
            )
            _, placed, _ = grpc_generate(vllm_cluster, b, PD)
            long_decision = long_prompt.result()[1]
            assert long_decision.prefill_instance == holder_a, long_decision
        if placed.prefill_instance != holder_a:
            break
    holder_b = placed.prefill_instance
    assert holder_b != holder_a, "prefix B was never placed on the other prefill worker"

    reused = len(a) // BLOCK * BLOCK
    for prefix, holder, other in ((a, holder_a, holder_b), (b, holder_b, holder_a)):
        deadline = time.monotonic() + 10
        while True:  # B's blocks reach kvmeta through vLLM's events, then Algorithm 1 sees them
            _, decision, usage = grpc_generate(vllm_cluster, prefix + [4, 5], PD)
            if decision.prefix_len > 0 or time.monotonic() > deadline:
                break
        assert (decision.prefill_instance, decision.prefix_len, decision.copy_from) == (holder, reused, "")
        assert usage.cached_tokens == reused  # vLLM's own count
        assert {c.instance_id: c.prefix_len for c in decision.candidates} == {holder: reused, other: 0}
    # The prompt KV crossed vLLM's MooncakeConnector from both prefill workers (its push statistics, counted
    # by the worker; a push is reported at the sender's next engine step, and each one stepped again since).
    loads = worker_loads(vllm_cluster)
    assert all(loads[i].kv_bytes_sent > 0 and loads[i].kv_blocks_sent > 0 for i in (holder_a, holder_b))


def test_kill_9_of_a_vllm_decode_worker_mid_stream_resumes_with_identical_output(vllm_cluster):
    prompt = _prompts(3, 1, 100, 101)[0]
    expected, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED, max_tokens=120)
    tokens, victim = kill_decode_worker_mid_stream(vllm_cluster, prompt, 120, after_tokens=10, timeout=180)
    assert victim is not None and victim not in vllm_cluster.manifest["processes"], "the decode worker was not killed"
    assert tokens == expected
