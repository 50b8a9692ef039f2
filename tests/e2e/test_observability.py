"""Tracing, metrics, reflection and cancellation on a live cluster."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import grpc
import helpers
import httpx
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvconductor.v1 import conductor_pb2, worker_pb2, worker_pb2_grpc


def _spans(run_dir: Path) -> list[dict]:
    spans = []
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        spans += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return spans


def test_one_trace_spans_gateway_conductor_prefill_transfer_and_decode(cluster):
    client = openai.OpenAI(base_url=cluster.rest, api_key="unused")
    client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "trace me " * 30}],
        max_tokens=6,
        extra_headers={"x-request-id": "traced-1"},
    )
    deadline = time.monotonic() + 10
    while True:
        spans = _spans(cluster.run_dir)
        generate = [s for s in spans if s["attributes"].get("kvconductor.client_request_id") == "traced-1"]
        if generate or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert generate, "the Conductor's Generate span was not exported"
    trace_id = generate[0]["context"]["trace_id"]
    time.sleep(1.5)  # let every process flush its batch
    in_trace = [s for s in _spans(cluster.run_dir) if s["context"]["trace_id"] == trace_id]
    by_service = defaultdict(set)
    for s in in_trace:
        by_service[s["resource"]["attributes"]["service.name"]].add(s["name"])
    assert "POST /v1/chat/completions" in by_service["kvconductor-gateway"]
    assert {"kvconductor.v1.Conductor/Generate", "conductor.schedule"} <= by_service["kvconductor-conductor"]
    # The prefix match runs on the Conductor's replica of kvmeta's index: no call to kvmeta per request.
    assert "kvconductor.v1.KvMeta/MatchPrefix" not in by_service["kvconductor-kvmeta"]
    assert {"kvconductor.v1.Prefill/Prefill", "prefill.compute", "prefill.kv_transfer"} <= by_service[
        "kvconductor-prefill"
    ]
    assert {"kvconductor.v1.Decode/Reserve", "kvconductor.v1.Decode/Decode"} <= by_service["kvconductor-decode"]
    # As the Conductor relayed them: the SLO's TBT (mean of the longest tenth of 6 tokens' 5 gaps: the longest)
    relayed = generate[0]["attributes"]
    assert relayed["kvconductor.completion_tokens"] == 6
    assert relayed["kvconductor.tbt_slo_ms"] == relayed["kvconductor.tbt_max_ms"] >= relayed["kvconductor.tbt_ms"] >= 0
    schedule = next(s for s in in_trace if s["name"] == "conductor.schedule")["attributes"]
    assert schedule["kvconductor.decision.prefill_instance"].startswith("prefill-")
    assert schedule["kvconductor.decision.predicted_ttft_ms"] > 0
    assert len(json.loads(schedule["kvconductor.decision.candidates"])) == 2
    transfer = next(s for s in in_trace if s["name"] == "prefill.kv_transfer")["attributes"]
    assert transfer["kvconductor.kv.bytes"] > 0 and transfer["kvconductor.kv.gbps"] > 0
    decode = next(s for s in in_trace if s["name"] == "kvconductor.v1.Decode/Decode")["attributes"]
    # The prefill made token 0, the decode the other 5; a busy machine lets the engine hand over several tokens in
    # one output, so there are at most 4 gaps between outputs and none when all 5 came at once.
    assert decode["kvconductor.decode.tokens"] == 5
    assert 0 <= decode["kvconductor.decode.steps"] <= 4
    if decode["kvconductor.decode.steps"]:
        assert 0 < decode["kvconductor.decode.tbt_mean_ms"] <= decode["kvconductor.decode.tbt_max_ms"]


def test_metrics_endpoints_report_traffic(cluster):
    records = helpers.records(cluster)
    sent, received = (f'kvconductor_kv_transfer_bytes_total{{direction="{d}"}}' for d in ("sent", "received"))

    def kv_bytes() -> tuple[float, float]:  # every prefill worker's sent bytes, the decode worker's received
        prefills = sum(
            helpers.scrape(records[("prefill", i)].metrics_address).get(sent, 0) for i in ("prefill-0", "prefill-1")
        )
        return prefills, helpers.scrape(records[("decode", "decode-0")].metrics_address).get(received, 0)

    # The counters are the shared cluster's since it started: a request of an earlier test whose KV was
    # written but whose decode never began (a client gone meanwhile) is sent and never received. Our two
    # requests' bytes must match.
    before = kv_bytes()
    for n in (50, 120):
        helpers.grpc_generate(cluster, list(range(1, n)), conductor_pb2.DEPLOYMENT_DISAGGREGATED)
    httpx.get(f"{cluster.rest}/models", timeout=10)
    conductor = helpers.scrape(records[("conductor", "conductor-0")].metrics_address)
    assert conductor['kvconductor_requests_total{outcome="completed",path="disaggregated"}'] >= 2
    assert conductor['kvconductor_ttft_seconds_count{path="disaggregated"}'] >= 2
    assert conductor['kvconductor_ttft_seconds_sum{path="disaggregated"}'] > 0
    assert conductor["kvconductor_prompt_tokens_total"] >= 49 + 119
    assert conductor['kvconductor_prediction_relative_error_count{metric="ttft"}'] >= 2
    after = kv_bytes()
    prefill_sent, decode_received = after[0] - before[0], after[1] - before[1]
    assert prefill_sent > 0 and decode_received == prefill_sent
    decode = helpers.scrape(records[("decode", "decode-0")].metrics_address)
    assert decode['kvconductor_kv_blocks{state="free"}'] > 0
    assert 'kvconductor_queue_length{state="running"}' in decode
    gateway = helpers.scrape(cluster.rest.removesuffix("/v1").removeprefix("http://"))
    assert gateway['kvconductor_http_requests_total{route="/v1/models",status="200"}'] >= 1


def test_reflection_lists_services_and_health_answers(cluster):
    with grpc.insecure_channel(cluster.conductor) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {
            "kvconductor.v1.Conductor",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def _load(cluster, instance_id):
    with grpc.insecure_channel(helpers.address_of(cluster, instance_id)) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)


def test_client_disconnect_frees_the_decode_workers_kv(cluster):
    idle = _load(cluster, "decode-0")
    assert idle.num_running == 0
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "a long answer please"}],
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.rest}/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        busy = _load(cluster, "decode-0")
        assert busy.num_running == 1 and busy.num_free_blocks < idle.num_free_blocks
    deadline = time.monotonic() + 15
    while (load := _load(cluster, "decode-0")).num_free_blocks != idle.num_free_blocks or load.num_running:
        assert time.monotonic() < deadline, f"decode still holds KV after the client left: {load}"
        time.sleep(0.2)
