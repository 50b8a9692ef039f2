"""The metrics port's plain-HTTP ``/health``: what a Kubernetes probe reads, following the gRPC health status."""

from __future__ import annotations

import httpx

from services.common.metrics import serve_metrics


def test_health_follows_the_serving_status_and_every_other_path_is_the_metrics():
    state = {"serving": True}
    address = serve_metrics("127.0.0.1", 0, lambda: state["serving"])
    reply = httpx.get(f"http://{address}/health", timeout=5)
    assert (reply.status_code, reply.json()) == (200, {"status": "serving"})
    state["serving"] = False
    reply = httpx.get(f"http://{address}/health?probe=liveness", timeout=5)
    assert (reply.status_code, reply.json()) == (503, {"status": "not serving"})
    metrics = httpx.get(f"http://{address}/metrics", timeout=5)
    assert metrics.status_code == 200 and "kvconductor_requests_total" in metrics.text
