"""An SLO rejection, from the Conductor's status to the gateway's 429: its own type, the key, retry-after."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
from grpc.aio import AioRpcError, Metadata

from scheduler.policy import Rejection
from services.common.config import load_config
from services.conductor.conductor import rejection_error
from services.gateway.gateway import _grpc_error

CONFIG = load_config(None, ["prefill.max_ttft_ms=2000", "decode.max_tbt_ms=200"])


def plan(ttft_s: float, t_queue_s: float) -> SimpleNamespace:
    return SimpleNamespace(ttft=ttft_s, prefill=SimpleNamespace(t_queue=t_queue_s))


def test_a_queue_that_breaks_the_ttft_slo_says_when_to_retry():
    error = rejection_error(Rejection("predicted TTFT 5200 ms exceeds the SLO of 2000 ms", plan(5.2, 4.0), "ttft_slo"),
                            CONFIG, colocated=False)  # fmt: skip
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the SLO is [prefill] max_ttft_ms = 2000" in error.message and "retry when it drains" in error.message
    assert dict(error.metadata) == {"kvconductor-rejection": "ttft_slo", "retry-after": "4"}  # 5.2 s - 2 s, up


def test_a_prompt_too_long_for_the_slo_even_alone_gets_no_retry_after():
    error = rejection_error(Rejection("predicted TTFT 9000 ms ...", plan(9.0, 0.5), "ttft_slo"), CONFIG, True)
    assert "[colocated] max_ttft_ms" in error.message and "even on an idle instance it takes 8500 ms" in error.message
    assert dict(error.metadata) == {"kvconductor-rejection": "ttft_slo"}
    tbt = rejection_error(Rejection("predicted TBT 250.0 ms ...", plan(1.0, 0.0), "tbt_slo"), CONFIG, False)
    assert "[decode] max_tbt_ms = 200" in tbt.message and "more decode workers" in tbt.message


def test_the_gateway_answers_its_own_error_type_with_the_headers():
    error = rejection_error(Rejection("predicted TTFT 5200 ms exceeds", plan(5.2, 4.0), "ttft_slo"), CONFIG, False)
    call = AioRpcError(error.code, Metadata(), Metadata(*error.metadata), details=error.message)
    response = _grpc_error(call, "r1")
    body = json.loads(response.body)["error"]
    assert response.status_code == 429 and (body["type"], body["code"]) == ("slo_rejection_error", "ttft_slo")
    assert response.headers["retry-after"] == "4" and response.headers["x-should-retry"] == "false"
    kind = Metadata(("kvconductor-rejection", "capacity"))
    capacity = AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(), kind, details="rejected: no free blocks")
    assert json.loads(_grpc_error(capacity, "").body)["error"]["type"] == "capacity_error"
