"""The core holds under real clients: cancel storms, a frozen engine, a dead engine thread (issue 10).

One cluster of 2 prefill, 2 decode and 1 colocated workers with the test-only fault signals on
(``KVCONDUCTOR_FAULT_INJECTION=1``: SIGUSR1 kills a worker's engine thread, SIGUSR2 freezes and thaws
it) and a short watchdog floor. The tests run in file order and consume the cluster: the last one kills
a decode worker's engine.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import address_of, launch_cluster, reference_tokens, stop_cluster, wait_registered, worker_loads

from kvconductor.v1 import (
    colocated_pb2,
    colocated_pb2_grpc,
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.worker.main import EXIT_ENGINE_DIED, FAULT_INJECTION_ENV

PD, COLOCATED = conductor_pb2.DEPLOYMENT_DISAGGREGATED, conductor_pb2.DEPLOYMENT_COLOCATED
STALL_S = 8.0  # [scheduler] stall_timeout_s of this cluster (slow steps on a busy machine are not stalls)
STORM = 200  # streams cancelled at random moments, half through gRPC (both deployments), half through REST
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1", "colocated-0")


@pytest.fixture(scope="module")
def resilient(tmp_path_factory, model_dir):
    os.environ[FAULT_INJECTION_ENV] = "1"
    try:
        c = launch_cluster(
            tmp_path_factory.mktemp("resilience") / "run", model_dir, "prefill.node_count=2", "decode.node_count=2",
            "colocated.node_count=1", f"scheduler.stall_timeout_s={STALL_S}", "cluster.engine_heartbeat_timeout_s=5",
            "scheduler.reject_on_slo_violation=false", "scheduler.kv_cache_balancing_threshold=inf",
        )  # fmt: skip
    finally:
        del os.environ[FAULT_INJECTION_ENV]
    try:
        yield c
    finally:
        stop_cluster(c.process)


def _prompt(rng: random.Random, low: int = 40, high: int = 400) -> list[int]:
    return [rng.randrange(256) for _ in range(rng.randrange(low, high))]


def _request(prompt, deployment=PD, max_tokens=12, include_decision=True):
    return conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=prompt), deployment=deployment, include_decision=include_decision,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip


def _sampling(max_tokens):
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- cancel storm ------------------------------------------------------------------------------------


async def _grpc_stream(conductor: str, prompt, deployment, rng: random.Random) -> None:
    """One stream cancelled before token 0, mid-prefill or mid-decode."""
    async with grpc.aio.insecure_channel(conductor) as channel:
        call = conductor_pb2_grpc.ConductorStub(channel).Generate(_request(prompt, deployment, 40, False), timeout=60)
        mode = rng.choice(("timer", "tokens"))
        if mode == "timer":  # anywhere from before the Conductor planned it to mid-decode
            await asyncio.sleep(rng.uniform(0, 0.3))
            call.cancel()
            return
        wanted = rng.randrange(1, 20)
        async for message in call:
            wanted -= len(message.token_ids)
            if wanted <= 0:
                call.cancel()
                return


async def _rest_stream(client: httpx.AsyncClient, rest: str, prompt, rng: random.Random) -> None:
    """A streaming completion whose client hangs up after a few chunks (or before any)."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    chunks = rng.randrange(0, 15)
    async with client.stream("POST", f"{rest}/completions", json=body, timeout=60) as response:
        async for _ in response.aiter_lines():
            chunks -= 1
            if chunks <= 0:
                return  # leaving the block closes the connection mid-stream


async def _storm(cluster, rng: random.Random) -> list[BaseException]:
    limit = asyncio.Semaphore(8)
    errors: list[BaseException] = []

    async def one(i: int, client: httpx.AsyncClient) -> None:
        prompt = _prompt(rng, 20, 1500)  # up to ~0.3 s of prefill: cancels land mid-prefill too
        async with limit:
            try:
                if i % 2:
                    await _rest_stream(client, cluster.rest, prompt, rng)
                else:
                    await _grpc_stream(cluster.conductor, prompt, PD if i % 4 else COLOCATED, rng)
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                if not isinstance(e, asyncio.CancelledError) and e.code() != grpc.StatusCode.CANCELLED:
                    errors.append(e)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(i, client) for i in range(STORM)))
    return errors


def _serve_directly(cluster, prompt, prefill_id, decode_id, max_tokens=8) -> list[int]:
    """One request on a chosen prefill/decode pair, bypassing the Conductor (5 s bound per call)."""
    rid = f"direct-{uuid.uuid4().hex}"
    p_addr, d_addr = address_of(cluster, prefill_id), address_of(cluster, decode_id)
    with grpc.insecure_channel(p_addr) as p_channel, grpc.insecure_channel(d_addr) as d_channel:
        decode = decode_pb2_grpc.DecodeStub(d_channel)
        reserved = decode.Reserve(
            decode_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(prompt), sampling=_sampling(max_tokens)),
            timeout=5,
        )
        first = prefill_pb2_grpc.PrefillStub(p_channel).Prefill(
            prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=_sampling(max_tokens),
                                       destination=reserved.target),
            timeout=5,
        )  # fmt: skip
        tokens = [first.first_token_id]
        for chunk in decode.Decode(
            decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token_id=first.first_token_id,
                                     sampling=_sampling(max_tokens)),
            timeout=5,
        ):  # fmt: skip
            tokens += chunk.token_ids
    return tokens


def _colocated_directly(cluster, prompt, max_tokens=8) -> list[int]:
    with grpc.insecure_channel(address_of(cluster, "colocated-0")) as channel:
        request = colocated_pb2.ColocatedRequest(
            request_id=f"direct-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=_sampling(max_tokens)
        )
        return [t for chunk in colocated_pb2_grpc.ColocatedStub(channel).Generate(request, timeout=5)
                for t in chunk.token_ids]  # fmt: skip


def _wait_idle(cluster, timeout_s: float) -> dict:
    """Every worker's KV blocks back to all free and no reservation left, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = worker_loads(cluster)
        busy = {i: (load.num_free_blocks, load.num_total_blocks, load.num_reserved) for i, load in loads.items()
                if load.num_free_blocks != load.num_total_blocks or load.num_reserved}  # fmt: skip
        if not busy:
            return loads
        assert time.monotonic() < deadline, f"KV blocks not back after the storm (free, total, reserved): {busy}"
        time.sleep(0.2)


def test_cancel_storm_leaves_every_worker_serving_with_all_blocks_free(resilient, model_dir):
    rng = random.Random(10)
    errors = asyncio.run(_storm(resilient, rng))
    assert not errors, f"streams failed with something other than their own cancellation: {errors[:3]}"
    # kv_transfer_timeout_s is 30 s: blocks back within 10 s means nothing waited for a reservation to expire.
    _wait_idle(resilient, timeout_s=10)
    prompt = _prompt(rng)
    expected = reference_tokens(model_dir, [prompt], max_tokens=8)[0]
    for prefill_id, decode_id in (("prefill-0", "decode-0"), ("prefill-1", "decode-1")):
        start = time.monotonic()
        assert _serve_directly(resilient, prompt, prefill_id, decode_id) == expected
        assert time.monotonic() - start < 5
    assert _colocated_directly(resilient, prompt) == expected
    for instance_id in WORKERS:
        with grpc.insecure_channel(address_of(resilient, instance_id)) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, instance_id


# -- a frozen engine -------------------------------------------------------------------------------


def _scheduling(cluster, instance_id: str) -> str:
    with grpc.insecure_channel(cluster.conductor) as channel:
        status = conductor_pb2_grpc.ConductorStub(channel).GetStatus(conductor_pb2.GetStatusRequest(), timeout=10)
    return next(i.scheduling for i in status.instances if i.instance_id == instance_id)


def _stream(cluster, request, on_message=None):
    """Tokens, the decision and the seconds the client waited."""
    tokens, decision = [], None
    start = time.monotonic()
    with grpc.insecure_channel(cluster.conductor) as channel:
        for message in conductor_pb2_grpc.ConductorStub(channel).Generate(request, timeout=120):
            tokens += message.token_ids
            decision = decision or (message.decision if message.HasField("decision") else None)
            if on_message is not None:
                on_message(tokens, decision)
    return tokens, decision, time.monotonic() - start


def _wait_back_in_pool(cluster, instance_id: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while _scheduling(cluster, instance_id) != "ok":
        assert time.monotonic() < deadline, f"{instance_id} never came back after it thawed"
        time.sleep(0.2)


def test_frozen_decode_engine_mid_stream_resumes_elsewhere_within_the_watchdog_bound(resilient, model_dir):
    prompt = _prompt(random.Random(11), 100, 101)
    expected = reference_tokens(model_dir, [prompt], max_tokens=150)[0]
    request = _request(prompt, PD, max_tokens=150)
    _, _, baseline = _stream(resilient, request)  # the request's own time, no fault
    frozen: list[str] = []

    def freeze(tokens, decision):
        if not frozen and len(tokens) >= 10:
            frozen.append(decision.decode_instance)
            os.kill(resilient.pid(decision.decode_instance), signal.SIGUSR2)

    try:
        tokens, decision, waited = _stream(resilient, request, freeze)
        assert frozen, "the stream ended before the freeze"
        assert tokens == expected  # resumed on the other decode worker, no gap, no repeat
        assert waited < STALL_S + 2 * baseline + 2.0, f"waited {waited:.1f} s (baseline {baseline:.1f} s)"
        assert _scheduling(resilient, frozen[0]) == "suspect"
        for seed in range(3):  # no new work goes to the frozen worker
            _, later, _ = _stream(resilient, _request(_prompt(random.Random(seed)), PD))
            assert later.decode_instance != frozen[0]
    finally:
        if frozen:
            os.kill(resilient.pid(frozen[0]), signal.SIGUSR2)  # thaw
    _wait_back_in_pool(resilient, frozen[0])


def test_frozen_prefill_engine_resumes_its_request_elsewhere(resilient, model_dir):
    rng = random.Random(12)
    prefix = _prompt(rng, 320, 321)
    prompt = prefix + [1, 2, 3]
    expected = reference_tokens(model_dir, [prompt])[0]
    _, first, baseline = _stream(resilient, _request(prefix, PD))
    holder = first.prefill_instance  # it caches the prefix: the Conductor will send the prompt there
    os.kill(resilient.pid(holder), signal.SIGUSR2)
    try:
        tokens, decision, waited = _stream(resilient, _request(prompt, PD))
        assert tokens == expected
        assert decision.prefill_instance != holder  # the decision shown is the attempt that streamed
        assert STALL_S <= waited < STALL_S + 2 * baseline + 2.0, f"waited {waited:.1f} s (baseline {baseline:.1f} s)"
        assert _scheduling(resilient, holder) == "suspect"
        with grpc.insecure_channel(address_of(resilient, holder)) as channel:  # alive, lease kept, not live
            deadline = time.monotonic() + 15
            while health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == (
                health_pb2.HealthCheckResponse.SERVING
            ):
                assert time.monotonic() < deadline, "a frozen engine kept reporting SERVING"
                time.sleep(0.5)
    finally:
        os.kill(resilient.pid(holder), signal.SIGUSR2)
    _wait_back_in_pool(resilient, holder)


# -- a dead engine thread --------------------------------------------------------------------------


def test_dead_engine_thread_leaves_the_cluster_and_its_request_completes_elsewhere(resilient, model_dir):
    prompt = _prompt(random.Random(13), 100, 101)
    expected = reference_tokens(model_dir, [prompt], max_tokens=150)[0]
    killed: list[str] = []

    def kill_engine(tokens, decision):
        if not killed and len(tokens) >= 10:
            killed.append(decision.decode_instance)
            os.kill(resilient.pid(decision.decode_instance), signal.SIGUSR1)

    tokens, _, _ = _stream(resilient, _request(prompt, PD, max_tokens=150), kill_engine)
    assert killed and tokens == expected
    victim = killed[0]
    wait_registered(resilient, "decode", victim, present=False, timeout=2)  # revoked at once, not after the TTL
    log = resilient.run_dir / "up.log"
    deadline = time.monotonic() + 10
    while f"{victim} exited ({EXIT_ENGINE_DIED})" not in log.read_text():
        assert time.monotonic() < deadline, "the worker did not exit with the engine-died status"
        time.sleep(0.2)
    resilient.manifest["processes"].pop(victim)
    assert _stream(resilient, _request(prompt, PD, max_tokens=12))[0] == expected[:12]
