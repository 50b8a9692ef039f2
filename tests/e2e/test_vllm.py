"""The vLLM backend on a real cluster: 2 prefill + 2 decode workers and 1 colocated worker, all vLLM (fp32).

The colocated worker is a single vLLM instance: the disaggregated path (KV over vLLM's MooncakeConnector)
must give its greedy tokens exactly. vLLM's KV events reach kvmeta, so Algorithm 1 sees ``prefix_len`` on
the prefill worker that holds a prefix and ``cached_tokens`` is vLLM's own count. Prefill runs in 64-token
chunks (the colocated worker too, so both compute the same KV), which keeps a long prompt on its prefill
worker for many engine steps. The tests run in file order; the last kills a decode worker.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    FAR_SLOS,
    conductor_status,
    grpc_generate,
    kill_decode_worker_mid_stream,
    kvmeta_matches,
    listeners_off,
    prefill_booked_on,
    running_cluster,
    wait_indexed,
    worker_loads,
)

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import conductor_pb2

pytestmark = pytest.mark.vllm
PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
COLOCATED = conductor_pb2.DEPLOYMENT_COLOCATED
BLOCK = 32
CHUNK = 64


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory, model_dir):
    with running_cluster(
        tmp_path_factory.mktemp("vllm") / "run", model_dir, 'engine.backend="vllm"',
        "prefill.node_count=2", "decode.node_count=2", "colocated.node_count=1",
        *(f"{pool}.prefix_cache_block_size={BLOCK}" for pool in ("prefill", "decode", "colocated")),
        f"prefill.max_num_batched_tokens={CHUNK}", f"colocated.max_num_batched_tokens={CHUNK}",
        *FAR_SLOS,
        "cluster.lease_ttl_s=6",  # five vLLM instances starting on two cores can starve etcd's lease keep-alives
    ) as c:  # fmt: skip
        yield c


def _prompts(seed, count, low=40, high=300):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def test_disaggregated_vllm_gives_the_tokens_of_a_single_vllm_instance(vllm_cluster):
    for prompt in _prompts(1, 4):
        single, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED)
        tokens, decision, _ = grpc_generate(vllm_cluster, prompt, PD)
        assert decision.decode_instance.startswith("decode-")
        assert tokens == single and len(tokens) == 12


def test_every_port_of_vllm_and_its_connector_stays_on_the_cluster_host(vllm_cluster):
    """vLLM's bootstrap server (0.0.0.0 in vLLM) and Mooncake's engine inside vLLM's processes included."""
    assert listeners_off(vllm_cluster) == []


def _place_two_prefixes(cluster, a, b, tail):
    """Cache ``a`` on one prefill worker and ``b`` on the other; their holders, or None if this try lost.

    ``a`` is cached by a long prompt that starts with it, and ``b`` is sent while that prompt prefills, so
    the Conductor's queue estimate (T_queue) sends ``b`` to the other worker, whichever worker the long
    prompt went to. A try is lost when the long prompt is done before ``b`` is scheduled, or when a prompt
    stalled under contention and resumed on the other worker (the progress watchdog), so that kvmeta
    shows its prefix on both.
    """
    with ThreadPoolExecutor(1) as pool:
        long_prompt = pool.submit(grpc_generate, cluster, a + tail * 3, PD, 2)  # about 3,600 tokens
        holder_a = prefill_booked_on(cluster, long_prompt)
        _, placed, _ = grpc_generate(cluster, b, PD)
        long_prompt.result()
    holder_b = placed.prefill_instance
    if holder_a is None or holder_b == holder_a:
        return None
    for prefix, holder, other in ((a, holder_a, holder_b), (b, holder_b, holder_a)):
        wait_indexed(cluster, prefix, holder, BLOCK)  # vLLM's events reach kvmeta, then Algorithm 1 sees them
        if kvmeta_matches(cluster, prefix_block_hashes(prefix, BLOCK)).get(other, 0):
            return None
    return holder_a, holder_b


def test_kvcache_centric_sends_each_repeated_prefix_to_the_prefill_worker_that_holds_it(vllm_cluster):
    prompts = _prompts(2, 9, 900, 901)
    for a, b, tail in zip(prompts[0::3], prompts[1::3], prompts[2::3], strict=True):  # three tries
        holders = _place_two_prefixes(vllm_cluster, a, b, tail)
        if holders is not None:
            break
    assert holders is not None, "prefixes A and B were never cached on different prefill workers"
    holder_a, holder_b = holders

    reused = len(a) // BLOCK * BLOCK
    for prefix, holder, other in ((a, holder_a, holder_b), (b, holder_b, holder_a)):
        _, decision, usage = grpc_generate(vllm_cluster, prefix + [4, 5], PD)
        estimates = [(c.instance_id, c.prefix_len, round(c.t_queue_ms), round(c.t_prefill_ms), round(c.t_send_ms))
                     for c in decision.candidates]  # fmt: skip
        assert (decision.prefill_instance, decision.prefix_len, decision.copy_from) == (holder, reused, ""), (
            f"candidates (id, prefix, T_queue, T_prefill, T_send ms): {estimates}; {conductor_status(vllm_cluster)}"
        )
        assert usage.cached_tokens == reused  # vLLM's own count
        assert {c.instance_id: c.prefix_len for c in decision.candidates} == {holder: reused, other: 0}
    # The prompt KV crossed vLLM's MooncakeConnector from both prefill workers (its push statistics, counted
    # by the worker; a push is reported at the sender's next engine step, and each one stepped again since).
    loads = worker_loads(vllm_cluster)
    assert all(loads[i].kv_bytes_sent > 0 and loads[i].kv_blocks_sent > 0 for i in (holder_a, holder_b))
    # Each prefill reply carries the pushes the connector timed since the last one: the Conductor learns each
    # prefill worker's send link from them (any destination: the connector names none).
    learned = {link.source: link.samples for link in conductor_status(vllm_cluster).links if not link.destination}
    assert all(learned.get(i, 0) > 0 for i in (holder_a, holder_b)), learned


def test_kill_9_of_a_vllm_decode_worker_mid_stream_resumes_with_identical_output(vllm_cluster):
    prompt = _prompts(3, 1, 100, 101)[0]
    expected, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED, max_tokens=120)
    tokens, victim = kill_decode_worker_mid_stream(vllm_cluster, prompt, 120, after_tokens=10, timeout=180)
    assert victim is not None and victim not in vllm_cluster.manifest["processes"], "the decode worker was not killed"
    assert tokens == expected
