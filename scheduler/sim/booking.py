"""The Conductor's bookkeeping of what it has sent where, as the live Conductor keeps it.

The live Conductor does not see an instance's true state; it sees its own bookings (services/
cluster_view.py ``Assignment``): on a prefill instance the predicted prefill time of each request not
yet finished, on a decode instance each request's expected join time and decode duration. The policy's
inputs (``T_queue``, the decode ``Resident``s, free blocks) are computed from these bookings with the
same formulas, so that the simulated Conductor knows exactly as much as the live one.

``T_queue`` has two estimators. ``live`` is services/cluster_view.py's formula: the predicted prefill
time of every unfinished request minus the time since the oldest was *assigned*; under queueing the
oldest has waited behind others, so it subtracts that wait too and underestimates the queue (a backlog
of ten 1 s prefills, the oldest assigned 9 s ago and just started, reads as 1 s instead of 10 s).
``started`` (the default, the paper's "sum of predicted prefill times of the work queued") subtracts
only the time the running prefill has been running, which the worker reports with its load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.policy import Resident


def request_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a decode instance reserves for a whole request (prompt + max_tokens)."""
    return math.ceil((num_prompt_tokens + max_tokens) / block_size)


@dataclass
class Booking:
    """One request's footprint on an instance; absolute simulated times in seconds."""

    assigned_at: float
    predicted_prefill_s: float  # its own prefill time (on a prefill instance)
    context_tokens: int
    num_blocks: int
    expected_join: float = 0.0  # assignment + predicted TTFT
    expected_decode_s: float = 0.0  # expected output tokens x predicted TBT
    decode_started: float | None = None
    prefill_started: float | None = None

    def resident(self, now: float) -> Resident:
        """The request as part of a decode batch, relative to ``now`` (as the live Conductor computes it)."""
        join = max(1e-3, self.expected_join - now)
        if self.decode_started is not None:
            join = self.decode_started - now
        return Resident(join, join + self.expected_decode_s, self.context_tokens)


T_QUEUE_ESTIMATORS = ("started", "live")


class Bookings:
    """An instance's bookings with the Conductor's ``T_queue`` estimate."""

    def __init__(self, t_queue_estimator: str = "started") -> None:
        if t_queue_estimator not in T_QUEUE_ESTIMATORS:
            raise ValueError(f"t_queue estimator must be one of {', '.join(T_QUEUE_ESTIMATORS)}")
        self.estimator = t_queue_estimator
        self.items: dict[int, Booking] = {}
        self.num_blocks = 0
        self._prefill_s = 0.0

    def add(self, request_id: int, booking: Booking) -> None:
        """Book a request."""
        self.items[request_id] = booking
        self.num_blocks += booking.num_blocks
        self._prefill_s += booking.predicted_prefill_s

    def prefill_done(self, request_id: int) -> None:
        """Its prefill no longer counts toward ``T_queue`` (the live Conductor pops it from ``prefilling``)."""
        booking = self.items.get(request_id)
        if booking is not None and booking.predicted_prefill_s:
            self._prefill_s -= booking.predicted_prefill_s
            booking.predicted_prefill_s = 0.0

    def remove(self, request_id: int) -> None:
        """Forget a request (finished or rejected)."""
        self.prefill_done(request_id)
        booking = self.items.pop(request_id, None)
        if booking is not None:
            self.num_blocks -= booking.num_blocks

    def prefill_started(self, request_id: int, now: float) -> None:
        """The instance started this request's prefill (reported with its load)."""
        booking = self.items.get(request_id)
        if booking is not None:
            booking.prefill_started = now

    def t_queue(self, now: float) -> float:
        """Predicted seconds of prefill work ahead of a request arriving now."""
        pending = [b for b in self.items.values() if b.predicted_prefill_s]
        if not pending:
            return 0.0
        if self.estimator == "live":
            return max(0.0, self._prefill_s - (now - min(b.assigned_at for b in pending)))
        elapsed = 0.0
        for b in pending:
            if b.prefill_started is not None:
                elapsed += min(now - b.prefill_started, b.predicted_prefill_s)
        return max(0.0, self._prefill_s - elapsed)

    def residents(self, now: float) -> tuple[Resident, ...]:
        """The decode batch as the policy sees it."""
        return tuple(b.resident(now) for b in self.items.values())
