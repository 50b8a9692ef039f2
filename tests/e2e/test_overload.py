"""Overload: the Conductor refuses what it cannot serve within the SLO (HTTP 429 with the reason), and what it
accepts meets the SLO as the Conductor measures it (from its arrival to the first token)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time

import openai
import pytest
from helpers import cli, running_cluster, worker_record

from cli.client import ConductorClient

MAX_TTFT_S = 1.0
MAX_TBT_S = 0.1
# Predictions are estimates on a shared 2-core machine: an accepted request may miss by a margin, not by multiples.
# Under `make test-contended` (a busy loop on each core, tests/cpu_hog.py) the prefill worker's share of a core
# swings with every other process that wakes up: measured there, a request predicted at 829 ms took 1,567 ms.
TOLERANCE = 2.5 if os.environ.get("CPU_HOGS") else 1.5


@pytest.fixture(scope="module")
def slo_cluster(tmp_path_factory, model_dir):
    with running_cluster(
        tmp_path_factory.mktemp("overload") / "run", model_dir, "prefill.node_count=1", "decode.node_count=1",
        f"prefill.max_ttft_ms={MAX_TTFT_S * 1e3}", f"decode.max_tbt_ms={MAX_TBT_S * 1e3}",
    ) as c:  # fmt: skip
        yield c


async def _one(client, request_id, prompt):
    start = time.monotonic()
    try:
        stream = await client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": request_id},
        )
        arrivals = [time.monotonic() async for chunk in stream if chunk.choices and chunk.choices[0].text]
    except openai.RateLimitError as e:
        assert e.response.headers.get("x-should-retry") == "false"  # SDKs must not retry an SLO rejection
        error = e.response.json()["error"]
        assert (error["type"], error["code"]) == ("slo_rejection_error", "ttft_slo"), error  # not a rate limit
        assert "the SLO is [prefill] max_ttft_ms = 1000" in error["message"], error  # the key to raise
        return ("rejected", str(e), e.response.headers.get("retry-after"))
    return ("accepted", arrivals[0] - start, arrivals, request_id)


def _burst_prompt_len(cluster) -> int:
    """The longest burst prompt, up to 1,200 tokens, that the prefill worker's start-up profile puts at a third of
    the SLO at most: alone on idle workers it is admitted, twelve of them at once overflow the SLO."""
    profile = worker_record(cluster, "prefill").cost_model.profile
    assert profile is not None
    fitting = [n for n in range(100, 1201, 50) if profile[0].predict(n) <= MAX_TTFT_S / 3]
    assert fitting, f"the prefill worker's start-up profile {profile[0]} puts 100 tokens over {MAX_TTFT_S / 3:.2f} s"
    return fitting[-1]


def test_overload_gets_429_with_reasons_and_accepted_requests_meet_the_slo(slo_cluster):
    rng = random.Random(9)
    # A running cluster has refined its cost models from real steps; give this one a few to learn from.
    warmup = openai.OpenAI(base_url=slo_cluster.rest, api_key="unused")
    for n in (100, 400, 800, 1200, 300, 900):
        with contextlib.suppress(openai.RateLimitError):  # a busy machine may already refuse the longest
            warmup.completions.create(model="tiny-llama", prompt=[rng.randrange(256) for _ in range(n)], max_tokens=8)
    time.sleep(6)  # a refit happens every 5 s
    # On a slow (or busy) machine the start-up profile is slower too: the prompts shrink with it.
    n = _burst_prompt_len(slo_cluster)
    prompts = [[rng.randrange(256) for _ in range(n)] for _ in range(12)]

    async def burst():
        async with openai.AsyncOpenAI(base_url=slo_cluster.rest, api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(_one(client, f"burst-{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(burst())
    rejected = [r[1] for r in results if r[0] == "rejected"]
    accepted = [r for r in results if r[0] == "accepted"]
    assert rejected, "a burst of 12 long prompts on one prefill worker must overflow a 1 s TTFT SLO"
    assert accepted
    assert all("predicted TTFT" in reason and "exceeds the SLO of 1000 ms" in reason for reason in rejected)
    # Twelve prompts each a third of the SLO alone: the queue is what breaks it, so waiting would help.
    assert any(r[2] is not None and int(r[2]) >= 1 for r in results if r[0] == "rejected"), rejected
    # A probe is admitted although its prediction misses the SLO (its instances were idle, so it relearns the
    # models); the SLO promise holds for the others. Only the burst's first request can find the worker idle.
    with ConductorClient(slo_cluster.conductor) as conductor:
        decisions = [conductor.explain(r[3]) for r in accepted]
    promised = [d for d in decisions if not d.probe]
    assert len(decisions) - len(promised) <= 1
    # The promise is the Conductor's, on the times it measures. On a busy machine the gateway's and this
    # client's own share of the cores come on top (under `make test-contended`: 0.71 s inside, 1.19 s here).
    for d in promised:
        assert 0 < d.outcome.ttft_ms <= MAX_TTFT_S * 1e3 * TOLERANCE, d
        assert d.outcome.tbt_ms <= MAX_TBT_S * 1e3 * TOLERANCE, d
    assert all(len(r[2]) > 1 for r in accepted)  # and every accepted request streamed its tokens
    status = cli(slo_cluster, "status")
    counted = re.search(r"rejected since the Conductor started: (\d+) \(ttft_slo (\d+)", status.stdout)
    assert counted and int(counted[1]) == int(counted[2]) >= len(rejected), status.stdout  # warm-up ones too
