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


def _watchdog(stall_factor: float = 4.0) -> ConductorServicer:
    config = Config()
    config.scheduler.stall_factor = stall_factor
    return ConductorServicer(config, ClusterView(), tokenizer=None)


async def _after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


async def test_a_slow_engine_that_turns_keeps_its_request_past_the_bound():
    view = SimpleNamespace(instance_id="prefill-0", worker_stub=WorkerStub(age_s=0.01))
    assert await _watchdog()._unless_stalled(asyncio.ensure_future(_after(0.5)), view, "prefill", 0.2) == "done"
    assert view.worker_stub.calls >= 2  # asked at each bound, and the engine had turned


async def test_a_frozen_engine_loses_its_request_at_the_bound():
    view = SimpleNamespace(instance_id="prefill-0", worker_stub=WorkerStub(age_s=60.0))
    pending = asyncio.ensure_future(_after(30))
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="no prefill progress"):
        await _watchdog()._unless_stalled(pending, view, "prefill", 0.2)
    assert time.monotonic() - start < 10 and view.worker_stub.calls == 1
    await asyncio.sleep(0)
    assert pending.cancelled()


async def test_a_request_that_never_ends_on_a_turning_engine_is_abandoned_after_stall_factor_bounds():
    view = SimpleNamespace(instance_id="decode-0", worker_stub=WorkerStub(age_s=0.01))
    with pytest.raises(WorkerFailure, match="no decode progress"):
        await _watchdog(stall_factor=3)._unless_stalled(asyncio.ensure_future(_after(30)), view, "decode", 0.1)
    assert view.worker_stub.calls == 2  # asked after the first two bounds; the third is the last
