"""The live Conductor waits out a deferred colocated prompt (``Rejection.retry_in``) and plans it again."""

import asyncio
import time
from types import SimpleNamespace

from kvconductor.v1 import common_pb2
from scheduler.booking import Booking
from scheduler.cost_model import DecodeModel, PrefillModel
from scheduler.disaggregation import is_local
from scheduler.instance import InstanceState
from services.common import metrics
from services.common.config import Config
from services.conductor.cluster_view import ClusterView
from services.conductor.conductor import ConductorServicer
from services.conductor.job import Job

PREFILL = PrefillModel(c0=0.01, c1=1e-4, c2=1e-9)  # 0.1 s per 1k tokens
DECODE = DecodeModel(d0=0.02, d1=1e-3, d2=1e-7)


def _instance(instance_id: str, leaves_in: float) -> SimpleNamespace:
    """A colocated instance with one request decoding there that is expected to leave in ``leaves_in`` seconds."""
    state = InstanceState(instance_id, "colocated", PREFILL, DECODE, num_blocks=100_000, max_running=64,
                          chunk_tokens=512)  # fmt: skip
    now = time.monotonic()
    booking = Booking(now, 0.0, 500, 10, now, leaves_in)
    booking.decode_started = now
    state.decoding.add("short", booking)
    record = SimpleNamespace(block_size=16, kv_layout=SimpleNamespace(bytes_per_block=1024))
    return SimpleNamespace(instance_id=instance_id, state=state, record=record)


async def test_a_prompt_that_would_push_every_decode_waits_for_one_to_leave_and_is_planned_there():
    config = Config()
    config.colocated.max_ttft_ms, config.colocated.max_tbt_ms = 10_000, 50
    conductor = ConductorServicer(config, ClusterView(), tokenizer=None)
    conductor._prefix_lens = lambda job, pool, store="": {}  # nothing cached: no KV index here
    c0, c1 = _instance("c0", 0.3), _instance("c1", 5.0)
    job = Job("r", list(range(8192)), common_pb2.SamplingParams(max_tokens=32), [], path="colocated")
    deferrals = metrics.DEFERRALS._value.get()

    async def finish_c0_after(seconds: float) -> None:  # as the live stream's end releases it
        await asyncio.sleep(seconds)
        conductor.core.release("short", time.monotonic(), c0.state)

    done = asyncio.ensure_future(finish_c0_after(0.3))
    start = time.monotonic()
    pool = [c0, c1]
    plan = await conductor._plan(job, pool, pool)  # one pool in both roles: the colocated path
    await done
    assert is_local(plan) and plan.decode_instance == "c0", plan.reason
    assert metrics.DEFERRALS._value.get() > deferrals
    assert 0.25 <= job.deferred_s <= min(1.0, time.monotonic() - start)  # until c0's request left, not c1's
    assert plan.ttft >= job.deferred_s  # the wait is in its predicted TTFT
    assert "waiting for a request decoding there to leave" in conductor.decisions.get("r").reason
