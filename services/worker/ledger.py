"""The requests a worker holds and what their Conductors booked for them: the load every Conductor shares.

Each Conductor keeps its own bookings (``scheduler.booking``) and sends each request's booking with the
request. The worker keeps them here while it holds the request (a prefill while it computes, a decode
reservation until its stream ends, a colocated request throughout) and streams them (``Worker.WatchLoad``)
to every Conductor, leaving out the watcher's own: a Conductor counts the other Conductors' requests on top
of its own bookings, so two replicas do not over-commit one worker. The stream only needs the bookings the
other replicas made; the watcher's own are counted (``own_requests``, ``own_blocks``) so it can measure
how far its view lagged behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from kvconductor.v1 import common_pb2, worker_pb2

KEEPALIVE_S = 1.0  # a report at least this often, changed or not: a watcher knows the stream is alive
DEFAULT_PERIOD_S = 0.05


@dataclass
class Entry:
    """One held request."""

    booking: common_pb2.Booking
    received: float  # monotonic
    prefill_done: bool = False
    decode_started: float | None = None
    tokens_out: int = 0  # counted at each token; read by the next report (a token alone sends none)


class Ledger:
    """Requests held, by request id; a version that changes at every change."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.version = 0
        self._changed = asyncio.Event()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()

    def add(self, request_id: str, booking: common_pb2.Booking) -> None:
        """A request arrived with its booking (an unbooked one, e.g. from a test client, is not shared)."""
        if booking.conductor_id:
            self.entries[request_id] = Entry(booking, time.monotonic())
            self._bump()

    def prefill_done(self, request_id: str) -> None:
        """Its prefill here is over; on a colocated worker it decodes from now."""
        entry = self.entries.get(request_id)
        if entry is not None and not entry.prefill_done:
            entry.prefill_done = True
            entry.decode_started = time.monotonic() if entry.booking.num_blocks else None
            self._bump()

    def decode_started(self, request_id: str) -> None:
        """A reserved request joins the decode batch."""
        entry = self.entries.get(request_id)
        if entry is not None and entry.decode_started is None:
            entry.prefill_done, entry.decode_started = True, time.monotonic()
            entry.tokens_out = 1  # token 0 came with its prefill
            self._bump()

    def produced(self, request_id: str, num_tokens: int) -> None:
        """The request produced ``num_tokens`` more output tokens here."""
        entry = self.entries.get(request_id)
        if entry is not None:
            entry.tokens_out += num_tokens

    def remove(self, request_id: str) -> None:
        """The worker no longer holds the request."""
        if self.entries.pop(request_id, None) is not None:
            self._bump()

    @contextmanager
    def holding(self, request_id: str, booking: common_pb2.Booking) -> Iterator[None]:
        """Hold the request for the duration of the block."""
        self.add(request_id, booking)
        try:
            yield
        finally:
            self.remove(request_id)

    def report(self, conductor_id: str) -> worker_pb2.LoadReport:
        """The requests other Conductors booked here, and the watcher's own counts."""
        now = time.monotonic()
        report = worker_pb2.LoadReport()
        for request_id, e in self.entries.items():
            if e.booking.conductor_id == conductor_id:
                report.own_requests += 1
                report.own_blocks += e.booking.num_blocks
                continue
            report.foreign.append(
                worker_pb2.BookedRequest(
                    request_id=request_id,
                    booking=e.booking,
                    age_s=now - e.received,
                    prefill_done=e.prefill_done,
                    decode_age_s=now - e.decode_started if e.decode_started is not None else -1.0,
                    tokens_out=e.tokens_out,
                )  # fmt: skip
            )
        return report

    async def reports(self, conductor_id: str, period_s: float) -> AsyncIterator[worker_pb2.LoadReport]:
        """A report now, then one after each change (at most one per ``period_s``) or ``KEEPALIVE_S``."""
        period_s = period_s if period_s > 0 else DEFAULT_PERIOD_S
        sent = -1
        while True:
            if self.version == sent:
                self._changed.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), KEEPALIVE_S)
            sent = self.version
            yield self.report(conductor_id)
            await asyncio.sleep(period_s)
