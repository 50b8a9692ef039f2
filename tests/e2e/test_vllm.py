"""The vLLM backend on a real cluster: 1 prefill + 2 decode workers and 1 colocated worker, all vLLM (fp32).

The colocated worker is a single vLLM instance: the disaggregated path (KV over vLLM's MooncakeConnector)
must give its greedy tokens exactly. vLLM's KV events reach kvmeta, so Algorithm 1 sees ``prefix_len`` on
the prefill worker and ``cached_tokens`` is vLLM's own count. The tests run in file order; the last kills a
decode worker.
"""

from __future__ import annotations

import random
import time

import pytest
from helpers import grpc_generate, kill_decode_worker_mid_stream, launch_cluster, stop_cluster

from kvconductor.v1 import conductor_pb2

pytestmark = pytest.mark.vllm
PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
COLOCATED = conductor_pb2.DEPLOYMENT_COLOCATED
BLOCK = 32


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory, model_dir):
    c = launch_cluster(
        tmp_path_factory.mktemp("vllm") / "run", model_dir, 'engine.backend="vllm"',
        "prefill.node_count=1", "decode.node_count=2", "colocated.node_count=1",
        *(f"{pool}.prefix_cache_block_size={BLOCK}" for pool in ("prefill", "decode", "colocated")),
        "prefill.max_ttft_ms=60000", "decode.max_tbt_ms=10000", "colocated.max_ttft_ms=60000",
        "colocated.max_tbt_ms=10000",
        "cluster.lease_ttl_s=6",  # four vLLM instances starting on two cores can starve etcd's lease keep-alives
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


def test_a_repeated_prefix_is_found_in_vllms_cache(vllm_cluster):
    prefix = _prompts(2, 1, 200, 201)[0]
    grpc_generate(vllm_cluster, prefix + [1, 2, 3], PD)
    deadline = time.monotonic() + 10
    while True:  # the first request's blocks reach kvmeta through vLLM's events, then Algorithm 1 sees them
        _, decision, usage = grpc_generate(vllm_cluster, prefix + [4, 5], PD)
        if decision.prefix_len > 0 or time.monotonic() > deadline:
            break
    reused = len(prefix) // BLOCK * BLOCK
    assert (decision.prefill_instance, decision.prefix_len, decision.copy_from) == ("prefill-0", reused, "")
    assert usage.cached_tokens == reused  # vLLM's own count


def test_kill_9_of_a_vllm_decode_worker_mid_stream_resumes_with_identical_output(vllm_cluster):
    prompt = _prompts(3, 1, 100, 101)[0]
    expected, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED, max_tokens=120)
    tokens, victim = kill_decode_worker_mid_stream(vllm_cluster, prompt, 120, after_tokens=10, timeout=180)
    assert victim is not None and victim not in vllm_cluster.manifest["processes"], "the decode worker was not killed"
    assert tokens == expected
