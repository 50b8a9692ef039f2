"""``bench compare --routers`` live: a third-party router from PyPI in front of our colocated workers.

One colocated cluster (two workers, publishing their KV events in vLLM's ZMQ format too); the quickest router
to start goes in front of the workers' own OpenAI endpoints (``openai_url`` in etcd) and a few requests go
through it. Skipped, with the reason, when neither router package is importable; the kv_aware test needs
vllm-router.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import running_cluster, wait_indexed

from bench.compare.peers import Contender, router_available, running_router
from bench.compare.routers import kv_event_args
from bench.compare.worker_metrics import cluster_workers, scrape_all, worker_deltas
from bench.serve.runner import Target, run
from bench.serve.workloads import shared_prefix

ROUTER = next((r for r in ("sglang", "vllm") if router_available(r) is None), None)
NO_ROUTER = "neither sglang-router nor vllm-router is installed (pip install -e .[dev])"


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, model_dir):
    if ROUTER is None:
        pytest.skip(NO_ROUTER)
    run_dir = tmp_path_factory.mktemp("routers") / "run"
    with running_cluster(
        run_dir, model_dir, "prefill.node_count=0", "decode.node_count=0", "colocated.node_count=2",
        "engine.zmq_kv_events=true",
    ) as c:  # fmt: skip
        yield c


def _through_router(cluster, policy: str, requests, log_dir: Path):
    """Send ``requests`` through the router with ``policy`` in front of the workers: results and per-worker deltas."""
    workers = cluster_workers(cluster.manifest)
    contender = Contender(f"{ROUTER}:{policy}", ROUTER, policy, "colocated")
    urls = ["--worker-urls", *(w.openai_url for w in workers)]
    with running_router(contender, urls, log_dir / "router.log") as base_url:
        before = scrape_all(workers)
        results, _ = asyncio.run(run(Target(base_url, "tiny-llama"), requests, 1, None, 0, True))
        return results, worker_deltas(before, scrape_all(workers))


def test_router_round_robin_reaches_both_cluster_workers(colocated, tmp_path: Path):
    assert len(cluster_workers(colocated.manifest)) == 2
    requests = shared_prefix(4, 1, 32, 8, 4, seed=1)  # four different prompts
    results, deltas = _through_router(colocated, "round_robin", requests, tmp_path)
    assert [r.error for r in results] == [None] * 4
    assert all(r.output_tokens == 4 and r.prompt_tokens and r.prompt_tokens > 40 for r in results)
    # Our workers answered: each one's own OpenAI endpoint served two of the four requests.
    assert sorted(d["http_requests"] for d in deltas.values()) == [2.0, 2.0]
    assert all(d["query_tokens"] > 0 for d in deltas.values())


def test_router_cache_aware_keeps_a_prefix_on_one_worker(colocated, tmp_path: Path):
    requests = shared_prefix(1, 3, 256, 8, 2, seed=2)  # one 256-token prefix, three suffixes
    results, deltas = _through_router(colocated, "cache_aware", requests, tmp_path)
    assert [r.error for r in results] == [None] * 3
    assert sorted(d["http_requests"] for d in deltas.values()) == [0.0, 3.0]
    # The workers' usage.cached_tokens comes back through the router: the repeats hit the prefix cache.
    assert results[0].cached_tokens is not None and results[0].cached_tokens < 64  # at most the chat header
    assert all(r.cached_tokens and r.cached_tokens >= 256 for r in results[1:])


def test_vllm_router_kv_aware_follows_our_workers_zmq_kv_events(colocated, tmp_path: Path):
    if router_available("vllm") is not None:
        pytest.skip(router_available("vllm"))
    workers = cluster_workers(colocated.manifest)
    assert all(w.kv_events_endpoint.startswith("tcp://127.0.0.1:") for w in workers)
    contender = Contender("vllm:kv_aware", "vllm", "kv_aware", "colocated")
    router_args = ["--worker-urls", *(w.openai_url for w in workers), *kv_event_args(workers, "tiny-llama")]
    a, b = (shared_prefix(1, 3, 256, 8, 2, seed=seed) for seed in (3, 4))
    with running_router(contender, router_args, tmp_path / "router.log") as base_url:  # subscribed from now on
        # Each worker caches a prefix of its own, sent to it directly: the router never saw these prompts, so only
        # the workers' events can tell it where the prefixes are.
        for worker, requests in zip(workers, (a, b), strict=True):
            direct = Target(worker.openai_url + "/v1", "tiny-llama", None, "completions")
            asyncio.run(run(direct, requests[:1], 1, None, 0, True))
            wait_indexed(colocated, list(requests[0].prompt_ids[:256]), worker.instance_id)  # published (kvmeta too)
        for worker, requests in zip(workers, (a, b), strict=True):
            before = scrape_all(workers)
            routed = Target(base_url, "tiny-llama", None, "completions")
            results, _ = asyncio.run(run(routed, requests[1:], 1, None, 0, True))
            assert [r.error for r in results] == [None, None]
            deltas = worker_deltas(before, scrape_all(workers))
            assert {w: d["http_requests"] for w, d in deltas.items() if d["http_requests"]} == {worker.instance_id: 2}
            assert all(r.cached_tokens and r.cached_tokens >= 256 for r in results)
