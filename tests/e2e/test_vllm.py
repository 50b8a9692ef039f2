"""The vLLM backend on a real cluster: 2 prefill + 2 decode workers and 1 colocated worker, all vLLM (fp32).

The colocated worker is a single vLLM instance: the disaggregated path (KV over vLLM's MooncakeConnector)
must give its greedy tokens exactly. vLLM's KV events reach kvmeta, so Algorithm 1 sees ``prefix_len`` on
the prefill worker that holds a prefix and ``cached_tokens`` is vLLM's own count. Prefill runs in 64-token
chunks (the colocated worker too, so both compute the same KV), which keeps a long prompt on its prefill
worker for many engine steps. The tests run in file order; the last kills a decode worker.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
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
from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc

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
    # Most lengths leave token 0's slot inside the prompt's last block: the decode request continues token 0.
    # A prompt that fills its last block, or all of it but one slot, has its decode sample token 0 again.
    rng = random.Random(2)
    edges = [[rng.randrange(256) for _ in range(n)] for n in (3 * BLOCK, 4 * BLOCK - 1)]
    for prompt in [*_prompts(1, 4), *edges]:
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
        # The other prefill worker holds nothing of it: it would compute the prompt, or copy the prefix first.
        plans = {c.instance_id: (c.prefix_len, c.copy_from) for c in decision.candidates}
        assert plans[holder] == (reused, "") and plans[other] in ((0, ""), (reused, holder)), plans
    # The prompt KV crossed vLLM's MooncakeConnector from both prefill workers (its push statistics, counted
    # by the worker; a push is reported at the sender's next engine step, and each one stepped again since).
    loads = worker_loads(vllm_cluster)
    assert all(loads[i].kv_bytes_sent > 0 and loads[i].kv_blocks_sent > 0 for i in (holder_a, holder_b))
    # Each prefill reply carries the pushes the connector timed since the last one: the Conductor learns each
    # prefill worker's send link from them (any destination: the connector names none).
    learned = {link.source: link.samples for link in conductor_status(vllm_cluster).links if not link.destination}
    assert all(learned.get(i, 0) > 0 for i in (holder_a, holder_b)), learned


def test_a_busy_vllm_holder_s_prefix_is_copied_to_the_other_prefill_worker_through_the_connector(vllm_cluster):
    """Hot-spot replication on vLLM: with prompts on a prefix piling up on its holder, the Conductor plans a copy.

    The puller runs the prefix as a remote-prefill request and the holder as an export (a request of its own,
    ahead of the prompts waiting there), so the blocks cross vLLM's MooncakeConnector into the puller's prefix
    cache; the prompt then hits them there, with the tokens that computing it gives.
    """
    prefix = _prompts(4, 1, 28 * BLOCK, 28 * BLOCK + 1)[0]
    _, first, _ = grpc_generate(vllm_cluster, prefix + [1], PD)
    holder = first.prefill_instance
    wait_indexed(vllm_cluster, prefix, holder, BLOCK)
    # At once, each with two chunks of its own to compute: the holder's queue grows with each by more than a
    # copy costs (the export's step, the bytes, the import's step).
    tails = _prompts(5, 8, 3 * BLOCK, 3 * BLOCK + 1)
    prompts = {f"hot-{k}": prefix + tail for k, tail in enumerate(tails)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = dict(zip(prompts, pool.map(lambda i: grpc_generate(vllm_cluster, prompts[i], PD, request_id=i),
                                             prompts), strict=True))  # fmt: skip
    copied = [i for i, (_, decision, _) in results.items() if decision.copy_from == holder]
    estimates = [[(c.instance_id, c.copy_from, round(c.t_queue_ms), round(c.t_transfer_ms), round(c.t_prefill_ms),
                   round(c.t_send_ms)) for c in d.candidates] for _, d, _ in results.values()]  # fmt: skip
    if not copied and os.environ.get("CPU_HOGS"):
        # With a busy loop on every core (`make test-contended`) the link learned from vLLM's pushes makes copying
        # the prefix cost about what recomputing it on the idle peer does (fp32 KV of a 135M model, 46 KB a token:
        # in one such run T_send was 386 ms for 1,088 tokens, recomputing the 896-token prefix 346 ms), so Algorithm
        # 1 recomputes there instead. That relieves the holder too, with the tokens of a single instance.
        moved = [i for i, (_, decision, _) in results.items() if decision.prefill_instance != holder]
        assert moved, f"all queued on the holder (id, copy from, T_queue, T_transfer, T_prefill, T_send): {estimates}"
        reference, _, _ = grpc_generate(vllm_cluster, prompts[moved[0]], COLOCATED)
        assert results[moved[0]][0] == reference
        return
    assert copied, f"no copy (id, copy from, T_queue, T_transfer, T_prefill, T_send ms): {estimates}"
    request_id = copied[0]
    tokens, decision, usage = results[request_id]
    puller = decision.prefill_instance
    assert puller != holder and decision.prefix_len == len(prefix)
    assert usage.cached_tokens == len(prefix)  # vLLM's own count on the puller: the copied blocks hit
    with grpc.insecure_channel(vllm_cluster.conductor) as channel:
        explained = conductor_pb2_grpc.ConductorStub(channel).ExplainDecision(
            conductor_pb2.ExplainDecisionRequest(request_id=request_id), timeout=10
        )
    # The puller may hold the prefix's first blocks already (a prompt of the burst computing there leaves them
    # chunk by chunk): it pulls the rest.
    copied = explained.outcome.copied_tokens
    assert 0 < copied <= len(prefix) and copied % BLOCK == 0 and explained.outcome.kv_copy_ms > 0, explained.outcome
    assert f"copies {len(prefix)} tokens of KV from {holder}" in explained.reason
    wait_indexed(vllm_cluster, prefix, puller, BLOCK)  # vLLM's events index the copied blocks on the puller
    reference, _, _ = grpc_generate(vllm_cluster, prompts[request_id], COLOCATED)
    assert tokens == reference
    # The Conductor learned the holder-to-puller link from the copy.
    links = {(link.source, link.destination): link.samples for link in conductor_status(vllm_cluster).links}
    assert links.get((holder, puller), 0) > 0, links


def test_kill_9_of_a_vllm_decode_worker_mid_stream_resumes_with_identical_output(vllm_cluster):
    prompt = _prompts(3, 1, 100, 101)[0]
    expected, _, _ = grpc_generate(vllm_cluster, prompt, COLOCATED, max_tokens=120)
    tokens, victim = kill_decode_worker_mid_stream(vllm_cluster, prompt, 120, after_tokens=10, timeout=180)
    assert victim is not None and victim not in vllm_cluster.manifest["processes"], "the decode worker was not killed"
    assert tokens == expected
