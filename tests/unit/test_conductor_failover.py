"""The gateway's Generate call goes on at another Conductor replica when its Conductor fails mid-stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc
from services.common.config import load_config
from services.common.instance_record import InstanceRecord
from services.common.registry import InstanceEvent
from services.gateway.conductors import Conductors

pytestmark = pytest.mark.asyncio(loop_scope="session")
OUTPUT = list(range(100, 110))


class Replica(conductor_pb2_grpc.ConductorServicer):
    """Streams OUTPUT one token at a time after the resumed ones; ``die_after`` tokens, then UNAVAILABLE."""

    def __init__(self, die_after: int | None) -> None:
        self.die_after = die_after
        self.requests: list[conductor_pb2.GenerateRequest] = []

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        start = len(request.resume_token_ids)
        for i, token in enumerate(OUTPUT[start:], start):
            if self.die_after is not None and i == self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the Conductor went away")
            yield conductor_pb2.GenerateResponse(token_ids=[token], finish_reason=2 if i == len(OUTPUT) - 1 else 0)


async def _serve(servicer: Replica) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    conductor_pb2_grpc.add_ConductorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _read_all(call) -> list[int]:
    tokens = []
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens += message.token_ids
    return tokens


@pytest.fixture
async def replicas():
    dying, healthy = Replica(die_after=4), Replica(die_after=None)
    (s1, a1), (s2, a2) = await _serve(dying), await _serve(healthy)
    conductors = Conductors(load_config(None, [f'cluster.scheduler_endpoint="{a1}"']), discover=False)
    conductors.addresses()  # attaches to this loop
    for name, address in (("conductor-0", a1), ("conductor-1", a2)):
        conductors.on_event(InstanceEvent("put", "conductor", name, InstanceRecord("conductor", name, address)))
    await asyncio.sleep(0.05)  # the events are applied on the loop
    yield conductors, dying, healthy, a1
    await s1.stop(0)
    await s2.stop(0)


async def test_a_stream_cut_by_its_conductor_goes_on_at_the_other_without_gap_or_repeat(replicas):
    conductors, dying, healthy, dying_address = replicas
    while conductors.addresses()[0] == dying_address:  # round-robin over two: the next turn is the dying one's
        pass
    call = conductors.generate(conductor_pb2.GenerateRequest(request_id="r", text="hi"))
    assert await _read_all(call) == OUTPUT
    assert len(dying.requests) == 1
    assert list(healthy.requests[-1].resume_token_ids) == OUTPUT[:4]
    assert healthy.requests[-1].request_id == "r"
    # the failed replica is avoided for a while: the next calls start at the healthy one
    assert conductors.addresses()[0] != dying_address and conductors.addresses()[0] != dying_address


async def test_an_error_that_is_the_requests_own_is_not_retried_elsewhere(replicas):
    conductors, dying, healthy, _ = replicas

    class Refusing(conductor_pb2_grpc.ConductorServicer):
        async def Generate(self, request, context):  # noqa: N802
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected: over the TTFT SLO")
            yield conductor_pb2.GenerateResponse()

    server, address = await _serve(Refusing())
    alone = Conductors(load_config(None, [f'cluster.scheduler_endpoint="{address}"']), discover=False)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _read_all(alone.generate(conductor_pb2.GenerateRequest(request_id="r", text="hi")))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await server.stop(0)


async def test_the_python_client_fails_over_between_replicas_too(replicas):
    from cli.client import ConductorClient

    conductors, dying, healthy, dying_address = replicas
    healthy_address = next(a for a in conductors.addresses() if a != dying_address)
    with ConductorClient([dying_address, healthy_address]) as client:  # the first call starts at the dying one
        result = await asyncio.to_thread(client.complete, "hi", max_tokens=len(OUTPUT))
    assert result.token_ids == OUTPUT
    assert list(healthy.requests[-1].resume_token_ids) == OUTPUT[:4]


async def test_a_departed_replicas_channel_is_closed_after_the_grace(replicas, monkeypatch):
    import services.gateway.conductors as module

    conductors, _, _, first = replicas
    second = next(a for a in conductors.addresses() if a != first)  # (the first is scheduler_endpoint: kept)
    monkeypatch.setattr(module, "CHANNEL_CLOSE_GRACE_S", 0.01)
    conductors.channel(second)
    conductors.on_event(InstanceEvent("delete", "conductor", "conductor-1", None))
    await asyncio.sleep(0.2)
    assert conductors.addresses() == [first]
    assert second not in conductors._channels  # closed, not kept trying a dead pod's address
