"""The decode worker's service over a fake engine, in process: reservations are never orphaned.

The servicer runs on a real gRPC server (port 0) and is called through real channels; only the engine
is the in-memory ``FakeEngine`` behind the EnginePort, so these tests take a second.
"""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import grpc
import pytest
from fake_engine import FakeEngine

from kvconductor.v1 import common_pb2, decode_pb2, decode_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.cost_model import DecodeModel, PrefillModel
from services.common.config import load_config
from services.common.rpc import ErrorInterceptor
from services.worker import decode
from services.worker.worker import Worker

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = list(range(40))


@pytest.fixture
async def served():
    engine = FakeEngine(num_blocks=64, step_s=0.002)
    engine.start()
    config = load_config(None, ["cluster.kv_transfer_timeout_s=30"])
    received = []  # the decode worker counts the blocks a prefill wrote into its reservation
    transfer = SimpleNamespace(endpoint="127.0.0.1:1", count_received=lambda blocks, nbytes: received.append(blocks))
    worker = Worker(
        "decode", "decode-0", config, config.decode, engine, transfer, None, None, None, PrefillModel(0, 0, 0),
        DecodeModel(0, 0, 0),
    )  # fmt: skip
    services, servicer = decode.services(worker)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    for s in services:
        s.add_to_server(s.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield SimpleNamespace(engine=engine, servicer=servicer, stub=decode_pb2_grpc.DecodeStub(channel),
                          worker=worker_pb2_grpc.WorkerStub(channel))  # fmt: skip
    await channel.close()
    await server.stop(0)


def _sampling(max_tokens=8):
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _reserve(stub, rid, max_tokens=8):
    return await stub.Reserve(
        decode_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(PROMPT), sampling=_sampling(max_tokens))
    )


async def _decode(stub, rid, max_tokens=8):
    request = decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=PROMPT, first_token_id=7, sampling=_sampling(max_tokens)
    )
    return [t async for chunk in stub.Decode(request) for t in chunk.token_ids]


async def _all_free(engine, timeout_s=2.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(engine.free) != engine.layout.num_blocks:
        assert asyncio.get_running_loop().time() < deadline, f"{engine.layout.num_blocks - len(engine.free)} held"
        await asyncio.sleep(0.01)


async def test_reserve_then_decode_streams_the_tokens_after_token_0_and_frees_the_blocks(served):
    reserved = await _reserve(served.stub, "r1")
    assert len(reserved.target.block_addresses) == 3  # 40 prompt tokens in 16-token blocks
    assert await _decode(served.stub, "r1") == list(range(8, 15))
    await _all_free(served.engine)


async def test_streams_cancelled_at_random_moments_leave_every_block_free(served):
    rng = random.Random(3)

    async def one(i):
        rid = f"c{i}"
        await _reserve(served.stub, rid, max_tokens=40)
        request = decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, first_token_id=7,
                                           sampling=_sampling(40))  # fmt: skip
        call = served.stub.Decode(request)
        await asyncio.sleep(rng.uniform(0, 0.05))
        call.cancel()
        # The Conductor releases a reservation its cancelled Decode may not have taken yet.
        await served.stub.Release(decode_pb2.ReleaseRequest(request_id=rid))

    await asyncio.gather(*(one(i) for i in range(12)))
    await _all_free(served.engine)
    assert not served.servicer.reservations


async def test_a_release_that_overtakes_its_reserve_leaves_nothing_held(served):
    released = await served.stub.Release(decode_pb2.ReleaseRequest(request_id="late"))
    assert not released.released
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _reserve(served.stub, "late")
    assert refused.value.code() == grpc.StatusCode.CANCELLED
    await _all_free(served.engine)


async def test_a_reserve_cancelled_mid_way_is_released_by_its_release(served):
    call = served.stub.Reserve(
        decode_pb2.ReserveRequest(request_id="cut", num_prompt_tokens=len(PROMPT), sampling=_sampling())
    )
    call.cancel()
    await served.stub.Release(decode_pb2.ReleaseRequest(request_id="cut"))
    await _all_free(served.engine)


async def test_a_reservation_is_held_through_the_prefill_the_conductor_planned(served):
    request = decode_pb2.ReserveRequest(request_id="long", num_prompt_tokens=len(PROMPT), sampling=_sampling(),
                                        hold_s=600.0)  # fmt: skip
    await served.stub.Reserve(request)
    held_until = served.servicer.reservations["long"] - time.monotonic()
    assert held_until > 600  # a prefill queued for minutes still finds its reservation (30 s alone before)
    await _reserve(served.stub, "short")
    assert served.servicer.reservations["short"] - time.monotonic() <= 30


async def test_a_hold_longer_than_the_configured_bound_is_refused_and_pins_nothing(served):
    for hold_s in (600.5, 1e9, -1.0):
        request = decode_pb2.ReserveRequest(request_id="pin", num_prompt_tokens=len(PROMPT), sampling=_sampling(),
                                            hold_s=hold_s)  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await served.stub.Reserve(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_reserve_hold_s" in refused.value.details()
    assert "pin" not in served.servicer.reservations
    await _all_free(served.engine)


async def test_no_rpc_of_one_request_touches_another_requests_blocks(served):
    """The Conductor gives every request an id of its own; the worker keeps each id's blocks apart."""
    engine = served.engine
    a, b = await _reserve(served.stub, "a"), await _reserve(served.stub, "b")
    assert not set(a.target.block_addresses) & set(b.target.block_addresses)
    held = engine.layout.num_blocks - len(engine.free)
    with pytest.raises(grpc.aio.AioRpcError) as duplicate:
        await _reserve(served.stub, "b")  # a second Reserve under b's id is refused, b's blocks stay b's
    assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "b" in served.servicer.reservations and engine.layout.num_blocks - len(engine.free) == held
    released = await served.stub.Release(decode_pb2.ReleaseRequest(request_id="a"))
    assert released.released and "b" in served.servicer.reservations
    assert engine.layout.num_blocks - len(engine.free) == held // 2  # a's blocks only
    assert not (await served.stub.Release(decode_pb2.ReleaseRequest(request_id="c"))).released  # no such id
    assert await _decode(served.stub, "b") == list(range(8, 15))  # b decodes as if a had never been there
    await _all_free(engine)


async def test_the_load_stream_shows_each_conductor_the_other_conductors_requests_until_they_end(served):
    booking = common_pb2.Booking(conductor_id="conductor-b", num_blocks=4, context_tokens=40, ttft_s=0.5)
    request = decode_pb2.ReserveRequest(request_id="rb", num_prompt_tokens=len(PROMPT), sampling=_sampling(),
                                        booking=booking)  # fmt: skip
    await served.stub.Reserve(request)
    a = served.worker.WatchLoad(worker_pb2.WatchLoadRequest(conductor_id="conductor-a", period_s=0.01))
    b = served.worker.WatchLoad(worker_pb2.WatchLoadRequest(conductor_id="conductor-b", period_s=0.01))
    seen_by_a, seen_by_b = await a.read(), await b.read()
    assert [(i.request_id, i.booking.num_blocks, i.decode_age_s < 0) for i in seen_by_a.foreign] == [("rb", 4, True)]
    assert (seen_by_b.own_requests, seen_by_b.own_blocks, len(seen_by_b.foreign)) == (1, 4, 0)
    decoding = asyncio.ensure_future(_decode(served.stub, "rb", max_tokens=200))
    report = await a.read()  # a change is reported at once
    while report.foreign and report.foreign[0].decode_age_s < 0:
        report = await a.read()
    assert report.foreign and report.foreign[0].prefill_done and report.foreign[0].tokens_out >= 1
    counted = 0  # the tokens it produced, as the ledger counts them for the next report
    while not decoding.done():
        entry = served.servicer.worker.ledger.entries.get("rb")
        counted = max(counted, entry.tokens_out if entry is not None else 0)
        await asyncio.sleep(0.001)
    assert counted > 1
    await decoding
    while (report := await a.read()).foreign:  # it ended: gone from the next report
        pass
    a.cancel()
    b.cancel()
