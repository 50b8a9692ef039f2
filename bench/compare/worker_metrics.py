"""What the benchmark's workers saw: their ids and URLs from etcd, and their own prefix-cache counters."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's ids and URLs, from its etcd record (``openai_url`` only on colocated workers)."""

    instance_id: str
    openai_url: str
    metrics_address: str
    kv_events_endpoint: str = ""  # its KV events in vLLM's ZMQ format, when the cluster publishes them
    block_size: int = 16


def cluster_workers(manifest: dict[str, Any], deployment: str = "colocated") -> list[WorkerInfo]:
    """The workers registered in the cluster that ``manifest`` (cluster.json) describes.

    Colocated: every colocated worker with an ``openai_url`` (the routers' targets); disaggregated: every
    prefill and decode worker; conditional: every prefill and colocated worker.
    """
    from services.common.instance_record import WorkerRecord
    from services.common.registry import Registry

    registry = Registry(manifest["etcd"], manifest["cluster"])
    by_deployment = {"colocated": ("colocated",), "conditional": ("prefill", "colocated")}
    roles = by_deployment.get(deployment, ("prefill", "decode"))
    workers = [
        WorkerInfo(
            instance_id, record.openai_url, record.metrics_address, record.kv_events_endpoint, record.block_size
        )  # fmt: skip
        for role in roles
        for (_, instance_id), record in sorted(registry.list(role).items())
        if isinstance(record, WorkerRecord) and (record.openai_url or deployment != "colocated")
    ]
    if not workers:
        raise RuntimeError(f"no {'/'.join(roles)} worker in etcd (node_count > 0? an openai_url when colocated?)")
    return workers


_SAMPLE = re.compile(r"^(kvconductor_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$")
COUNTERS = {
    "kvconductor_prefix_cache_query_tokens": "query_tokens",
    "kvconductor_prefix_cache_hit_tokens": "hit_tokens",
}


def scrape(worker: WorkerInfo) -> dict[str, float]:
    """The worker engine's prefix-cache counters and its OpenAI endpoint's completed chat/completions calls."""
    text = httpx.get(f"http://{worker.metrics_address}/metrics", timeout=5.0).text
    out = {"query_tokens": 0.0, "hit_tokens": 0.0, "http_requests": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in COUNTERS:
            out[COUNTERS[name]] += value
        elif name == "kvconductor_http_requests" and "completions" in labels and 'status="200"' in labels:
            out["http_requests"] += value
    return out


def scrape_all(workers: Sequence[WorkerInfo]) -> dict[str, dict[str, float]]:
    """``scrape`` of every worker, by instance id."""
    return {w.instance_id: scrape(w) for w in workers}


def worker_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per worker: counter increases, share of the prompt tokens looked up, engine hit rate."""
    deltas = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}
    total = sum(d["query_tokens"] for d in deltas.values())
    for d in deltas.values():
        d["token_share"] = d["query_tokens"] / total if total else 0.0
        d["hit_rate"] = d["hit_tokens"] / d["query_tokens"] if d["query_tokens"] else 0.0
    return deltas
