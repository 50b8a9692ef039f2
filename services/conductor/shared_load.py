"""Load shared between Conductor replicas: each worker's report of what the other Conductors booked there.

Every Conductor sends a request's booking with the request (``booking_message``); the worker holds it while
it holds the request and streams the other Conductors' bookings to each Conductor (``Worker.WatchLoad``,
services/worker/ledger.py). Here a Conductor follows one such stream per worker and keeps the latest as
the instance's foreign bookings, which ``InstanceState`` counts on top of its own. What the replicas do not
share: the link models and TTFT overhead each learns from its own requests (a new replica starts from the
priors and converges within its first requests; the cost models themselves are the workers', in etcd).

The window left open is a report's lag: a request another Conductor booked in the last period before this
one decides. Each report measures it: the requests (and KV blocks) the worker holds beyond what this
Conductor counted just before (its own bookings and the previous report's), kept as the maximum seen.

A foreign request's decode lasts as its own Conductor expected until the worker reports its progress
(tokens produced, counted at each token and read by the next report): from then on, like this Conductor's
own bookings, the time so far plus the tokens still expected at its measured pace (``Booking.progress``,
with this Conductor's expected lengths).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvconductor.v1 import common_pb2, worker_pb2
from scheduler.booking import Booking, Bookings
from scheduler.instance import InstanceState
from services.conductor.cluster_view import ClusterView, InstanceView

log = logging.getLogger(__name__)
REPORT_PERIOD_S = 0.05  # asked of the workers: at most this often, at every change
RETRY_S = 0.5  # a broken stream is reopened after this (while the instance is registered)


ExpectedTokens = Callable[[int, bool, int], int]  # (max_tokens, fixed_length, produced) -> expected output tokens


def booking_message(
    conductor_id: str, request_id: str, prefill: InstanceState | None, decode: InstanceState | None,
    max_tokens: int = 0, fixed_length: bool = False,
) -> common_pb2.Booking:  # fmt: skip
    """What this Conductor booked for ``request_id``: its prefill on ``prefill``, its decode on ``decode``."""
    message = common_pb2.Booking(conductor_id=conductor_id, max_tokens=max_tokens, fixed_length=fixed_length)
    p = prefill.prefilling.items.get(request_id) if prefill is not None else None
    if p is not None:
        message.predicted_prefill_s, message.new_tokens = p.predicted_prefill_s, p.new_tokens
        message.context_tokens = p.context_tokens
    d = decode.decoding.items.get(request_id) if decode is not None else None
    if d is not None:
        message.num_blocks, message.context_tokens = d.num_blocks, d.context_tokens
        message.ttft_s, message.expected_decode_s = d.expected_join - d.assigned_at, d.expected_decode_s
    return message


def foreign_bookings(
    report: worker_pb2.LoadReport, now: float, expected: ExpectedTokens | None = None
) -> tuple[Bookings, Bookings]:
    """(prefill, decode) bookings of the reported requests, oldest first: the queue order of the worker.

    ``expected``: how many output tokens a request is expected to produce (``ConductorCore``'s), for the
    decodes that reported progress.
    """
    prefilling, decoding = Bookings(), Bookings()
    for item in sorted(report.foreign, key=lambda i: -i.age_s):
        b, assigned = item.booking, now - item.age_s
        if b.predicted_prefill_s > 0 and not item.prefill_done:
            prefilling.add(item.request_id, Booking(assigned, b.predicted_prefill_s, b.context_tokens, 0,
                                                    new_tokens=b.new_tokens))  # fmt: skip
        if b.num_blocks:
            started = now - item.decode_age_s if item.decode_age_s >= 0 else None
            booking = Booking(assigned, 0.0, b.context_tokens, b.num_blocks, assigned + b.ttft_s, b.expected_decode_s,
                              decode_started=started)  # fmt: skip
            if started is not None and item.tokens_out and expected is not None:
                booking.progress(now, item.tokens_out, expected(b.max_tokens, b.fixed_length, item.tokens_out))
            decoding.add(item.request_id, booking)
    return prefilling, decoding


@dataclass
class Overcommit:
    """The most an instance held beyond what this Conductor counted, over its reports."""

    requests: int = 0
    blocks: int = 0


class SharedLoad:
    """One load stream per registered worker; the foreign bookings and the over-commit they reveal."""

    def __init__(self, view: ClusterView, conductor_id: str, expected: ExpectedTokens | None = None) -> None:
        self.view = view
        self.conductor_id = conductor_id
        self.expected = expected  # output lengths, for the foreign decodes' remaining time
        self.overcommit: dict[str, Overcommit] = {}
        self._streams: dict[str, tuple[InstanceView, asyncio.Task[None]]] = {}

    async def run(self, period_s: float = 0.25) -> None:
        """Follow the workers as they come and go (runs for ever)."""
        try:
            while True:
                self._sync()
                await asyncio.sleep(period_s)
        finally:
            for _, task in self._streams.values():
                task.cancel()

    def _sync(self) -> None:
        for instance_id, (view, task) in list(self._streams.items()):
            if self.view.instances.get(instance_id) is not view or task.done():
                task.cancel()
                del self._streams[instance_id]
        for instance_id, view in self.view.instances.items():
            if instance_id not in self._streams:
                self._streams[instance_id] = (view, asyncio.create_task(self._follow(view)))

    async def _follow(self, view: InstanceView) -> None:
        request = worker_pb2.WatchLoadRequest(conductor_id=self.conductor_id, period_s=REPORT_PERIOD_S)
        while True:
            try:
                async for report in view.worker_stub.WatchLoad(request):
                    self.apply(view.instance_id, view.state, report)
            except grpc.aio.AioRpcError as e:
                log.debug("load stream of %s broke (%s); reopening", view.instance_id, e.code().name)
            # a dead worker's stale foreign load would otherwise stay on its (departing) state
            view.state.foreign_prefilling, view.state.foreign_decoding = Bookings(), Bookings()
            await asyncio.sleep(RETRY_S)

    def apply(self, instance_id: str, state: InstanceState, report: worker_pb2.LoadReport) -> None:
        """Measure the lag the report reveals, then take its bookings as the instance's foreign ones."""
        counted = len(state.prefilling.items.keys() | state.decoding.items.keys()) + len(
            state.foreign_prefilling.items.keys() | state.foreign_decoding.items.keys()
        )
        held = report.own_requests + len(report.foreign)
        held_blocks = report.own_blocks + sum(i.booking.num_blocks for i in report.foreign)
        seen = self.overcommit.setdefault(instance_id, Overcommit())
        seen.requests = max(seen.requests, held - counted)
        seen.blocks = max(seen.blocks, held_blocks - state.booked_blocks)
        state.foreign_prefilling, state.foreign_decoding = foreign_bookings(report, time.monotonic(), self.expected)
