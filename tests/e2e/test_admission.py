"""Admission cannot lock itself out (issue 10): an overload burst, idle, then a steady load is admitted.

A 1 prefill + 1 decode cluster with a TTFT SLO is driven open-loop at about 3x its capacity for 10 s
(rejections expected), left idle for 10 s, then driven at about 30% of capacity for 25 s. The steady requests
must be admitted (at least 95%) and predicted well (median TTFT error at most 25%): neither the cost
models nor the learned TTFT overhead may keep what the burst taught them.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

import grpc
import pytest
from helpers import running_cluster

from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc

PROMPT_TOKENS = 600
MAX_TOKENS = 16
SLO_MS = 3000  # a 600-token prompt alone takes 0.15-1 s here, busy machine or not
MAX_ERROR = 0.25  # median TTFT prediction error over the steady requests (the bound)


@dataclass
class Outcome:
    admitted: bool
    predicted_ttft_ms: float = 0.0
    request_id: str = ""


@pytest.fixture(scope="module")
def small(tmp_path_factory, model_dir):
    with running_cluster(
        tmp_path_factory.mktemp("admission") / "run", model_dir, "prefill.node_count=1", "decode.node_count=1",
        f"prefill.max_ttft_ms={SLO_MS}", "decode.max_tbt_ms=1000",
    ) as c:  # fmt: skip
        yield c


async def _one(stub, rng: random.Random) -> Outcome:
    request = conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=[rng.randrange(256) for _ in range(PROMPT_TOKENS)]),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        deployment=conductor_pb2.DEPLOYMENT_DISAGGREGATED, include_decision=True,
    )  # fmt: skip
    outcome = Outcome(admitted=True)
    try:
        async for message in stub.Generate(request, timeout=120):
            if message.HasField("decision"):
                outcome.predicted_ttft_ms = message.decision.predicted_ttft_ms
                outcome.request_id = message.request_id
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e  # a rejection, nothing else
        return Outcome(admitted=False)
    return outcome


async def _drive(conductor: str, rate: float, seconds: float, seed: int) -> list[Outcome]:
    """Open-loop requests at ``rate`` per second for ``seconds``."""
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        tasks = []
        start = time.monotonic()
        for i in range(round(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(_one(stub, rng)))
        return list(await asyncio.gather(*tasks))


async def _sequential(conductor: str, count: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        return [await _one(stub, rng) for _ in range(count)]


def _measured_ttft_ms(conductor: str, request_id: str) -> float:
    with grpc.insecure_channel(conductor) as channel:
        decision = conductor_pb2_grpc.ConductorStub(channel).ExplainDecision(
            conductor_pb2.ExplainDecisionRequest(request_id=request_id), timeout=10
        )
    assert decision.outcome.ttft_ms > 0, f"no measured TTFT recorded for {request_id}"
    return decision.outcome.ttft_ms


def test_an_overload_burst_does_not_lock_admission_out(small):
    # Capacity: the prefill worker runs prompts one at a time, so it is about 1 / (prefill time of one).
    warm = asyncio.run(_sequential(small.conductor, 4, seed=0))  # one at a time: TTFT = the prefill alone
    assert all(o.admitted for o in warm)
    prefill_s = statistics.median(_measured_ttft_ms(small.conductor, o.request_id) for o in warm) / 1e3
    capacity = 1 / prefill_s
    burst = asyncio.run(_drive(small.conductor, rate=3 * capacity, seconds=10, seed=1))
    assert not all(o.admitted for o in burst), "the burst was not an overload"
    time.sleep(10)
    steady = asyncio.run(_drive(small.conductor, rate=0.3 * capacity, seconds=25, seed=2))
    admitted = [o for o in steady if o.admitted]
    assert len(admitted) >= 0.95 * len(steady), f"{len(steady) - len(admitted)} of {len(steady)} rejected"
    pairs = [(o.predicted_ttft_ms, _measured_ttft_ms(small.conductor, o.request_id)) for o in admitted]
    error = statistics.median(abs(p - m) / m for p, m in pairs)
    shown = ", ".join(f"{p:.0f}/{m:.0f}" for p, m in pairs)
    # Under `make test-contended` the hogs make equal requests take unequal times (measured there: 289-645 ms for
    # the same prompt length), which no prediction can follow: the margin is the measurements' own scatter.
    measured = [m for _, m in pairs]
    center = statistics.median(measured)
    scatter = statistics.median(abs(m - center) / center for m in measured) if os.environ.get("CPU_HOGS") else 0.0
    assert error <= MAX_ERROR + scatter, (
        f"median TTFT prediction error {error:.0%}, scatter {scatter:.0%} (predicted/measured ms: {shown})"
    )


def test_worker_endpoint_can_admit_what_the_conductor_refuses(tmp_path, model_dir):
    """``[scheduler] worker_endpoint_admission = false``: a colocated worker's own OpenAI endpoint, fronted by a
    third-party router, queues a request whose predicted TTFT breaks the SLO, as a stock vLLM or SGLang server
    would (no 429 for a circuit breaker to count); the Conductor behind the gateway still refuses it."""
    import httpx
    from helpers import worker_record

    with running_cluster(
        tmp_path / "run", model_dir, "prefill.node_count=0", "decode.node_count=0", "colocated.node_count=1",
        "colocated.max_ttft_ms=1", "scheduler.worker_endpoint_admission=false",
    ) as c:  # fmt: skip
        url = worker_record(c, "colocated").openai_url
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the worker's OpenAI endpoint never became healthy"
            time.sleep(0.2)
        body = {"model": "tiny-llama", "prompt": "Hello " * 100, "max_tokens": 4, "temperature": 0}
        refused = httpx.post(f"{c.rest}/completions", json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert "SLO" in refused.json()["error"]["message"]
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4
