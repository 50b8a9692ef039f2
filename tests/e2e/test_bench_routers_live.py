"""``bench compare --routers`` live: a third-party router from PyPI in front of our colocated workers.

One colocated cluster (two workers); the quickest router to start goes in front of the workers' own OpenAI
endpoints (``openai_url`` in etcd) and a few requests go through it. Skipped, with the reason, when neither
router package is importable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import running_cluster

from bench.compare.peers import Contender, router_available, running_router
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
        run_dir, model_dir, "prefill.node_count=0", "decode.node_count=0", "colocated.node_count=2"
    ) as c:
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
