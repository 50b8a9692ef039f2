"""The Conductor's progress watchdog: a slow engine that turns keeps its request, a frozen one loses it."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvconductor.v1 import worker_pb2
from services.common.config import Config
from services.conductor.cluster_view import ClusterView
from services.conductor.conductor import ConductorServicer
from services.conductor.job import WorkerFailure


class WorkerStub:
    """``GetLoad`` of a worker whose engine loop last turned ``age_s`` seconds ago."""

    def __init__(self, age_s: float) -> None:
        self.age_s, self.calls = age_s, 0

    async def GetLoad(self, request, timeout):  # noqa: N802
        self.calls += 1
        return worker_pb2.WorkerLoad(engine_heartbeat_age_s=self.age_s)


def _watchdog(stall_factor: float = 4.0, stall_timeout_s: float = 15.0) -> ConductorServicer:
    config = Config()
    config.scheduler.stall_factor = stall_factor
    config.scheduler.stall_timeout_s = stall_timeout_s
    return ConductorServicer(config, ClusterView(), tokenizer=None)


async def _after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


async def test_a_slow_engine_that_turns_keeps_its_request_past_the_bound():
    view = SimpleNamespace(instance_id="prefill-0", worker_stub=WorkerStub(age_s=0.01))
    pending = asyncio.ensure_future(_after(0.5))
    assert await _watchdog()._unless_stalled(lambda: asyncio.shield(pending), view, "prefill", 0.2) == "done"
    assert view.worker_stub.calls >= 2  # asked at each bound, and the engine had turned


async def test_a_frozen_engine_loses_its_request_at_the_bound():
    view = SimpleNamespace(instance_id="prefill-0", worker_stub=WorkerStub(age_s=60.0))
    pending = asyncio.ensure_future(_after(30))
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="no prefill progress"):
        await _watchdog()._unless_stalled(lambda: asyncio.shield(pending), view, "prefill", 0.2)
    assert time.monotonic() - start < 10 and view.worker_stub.calls == 1
    pending.cancel()


async def test_a_request_that_never_ends_on_a_turning_engine_is_abandoned_after_stall_factor_bounds():
    view = SimpleNamespace(instance_id="decode-0", worker_stub=WorkerStub(age_s=0.01))
    with pytest.raises(WorkerFailure, match="no decode progress"):
        await _watchdog(stall_factor=3)._unless_stalled(asyncio.Queue().get, view, "decode", 0.1)
    assert view.worker_stub.calls == 2  # asked after the first two bounds; the third is the last


async def test_a_stream_is_relayed_in_order_and_the_error_that_ends_it_reaches_the_request():
    async def stream():
        for i in range(50):  # more than the reader reads ahead
            yield i
        raise RuntimeError("the worker went away")

    view = SimpleNamespace(instance_id="decode-0", worker_stub=WorkerStub(age_s=0.01))
    got = []
    with pytest.raises(RuntimeError, match="went away"):
        async for message in _watchdog()._watch(stream(), view, "decode", 0.1, 0.1):
            got.append(message)
    assert got == list(range(50))


async def test_a_stream_that_stops_mid_way_on_a_frozen_engine_is_abandoned_and_stops_being_read():
    read = []

    async def stream():
        for i in range(3):
            read.append(i)
            yield i
        await asyncio.sleep(30)
        read.append("late")
        yield "late"

    view = SimpleNamespace(instance_id="decode-0", worker_stub=WorkerStub(age_s=60.0))
    got = []
    with pytest.raises(WorkerFailure, match="no decode progress"):
        async for message in _watchdog(stall_timeout_s=0.2)._watch(stream(), view, "decode", 0.1, 0.1):
            got.append(message)
    assert got == [0, 1, 2] and view.worker_stub.calls == 1
    await asyncio.sleep(0.05)
    assert read == [0, 1, 2]  # the reader went with the request
