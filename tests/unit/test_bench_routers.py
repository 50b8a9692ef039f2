"""``bench compare --routers``: contender specs and per-worker deltas (the live runs are in tests/e2e)."""

from __future__ import annotations

import pytest

from bench.compare.routers import (
    conductor_policy,
    parse_contender,
    worker_deltas,
)


def test_contender_specs():
    assert parse_contender("conductor", "least_loaded").label == "conductor (least_loaded)"
    assert parse_contender("vllm:power_of_two").label == "vllm-router power_of_two"
    with pytest.raises(ValueError, match="unknown contender"):
        parse_contender("sglang:kv_aware")
    assert conductor_policy(["scheduler.policy=round_robin", "gateway.port=0"]) == "round_robin"
    assert conductor_policy([]) == "kvcache_centric"


def test_worker_deltas_share_and_hit_rate():
    before = {"w0": {"query_tokens": 100.0, "hit_tokens": 0.0}, "w1": {"query_tokens": 0.0, "hit_tokens": 0.0}}
    after = {"w0": {"query_tokens": 400.0, "hit_tokens": 150.0}, "w1": {"query_tokens": 100.0, "hit_tokens": 0.0}}
    d = worker_deltas(before, after)
    assert d["w0"]["token_share"] == pytest.approx(0.75) and d["w0"]["hit_rate"] == pytest.approx(0.5)
    assert d["w1"]["token_share"] == pytest.approx(0.25) and d["w1"]["hit_rate"] == 0.0
