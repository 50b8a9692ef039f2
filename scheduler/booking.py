"""The Conductor's bookkeeping of what it sent where: the live Conductor and the simulator share it.

The Conductor does not see an instance's true state; it sees its own bookings. The policy's inputs are
computed from them:

* ``T_queue`` of a prefill instance: the predicted prefill work ahead of a new request. The instance
  works first come, first served, so the bookings keep the predicted time its queue drains
  (``busy_until``): a new booking starts when the queue drains, and a finished prefill restarts the
  clock for the ones still waiting. Subtracting the time since the oldest booking was *assigned*
  would count its own wait in the queue as progress and read a backlog as short. A prefill that runs
  past its predicted end does not make the ones behind it vanish: ``T_queue`` is never less than their
  predicted work (the late one's own remainder is unknown, counted as none).
* the decode batch: each request's expected join time (assignment + predicted TTFT, or the real
  start once token 0 arrived) and decode duration, as ``Resident``s. The duration starts as expected
  output tokens x predicted TBT; as tokens stream out it becomes the time so far plus the tokens left at
  the request's own measured pace. A prediction that runs short (a busy machine decodes slower than the
  models say) would otherwise read a batch still decoding as gone, and the policy would pile new
  requests onto the instance whose residents it wrongly thinks have left.
* free KV blocks: the instance's blocks minus those its bookings reserve.
* the prefix a prefill instance *will* hold: the prompts booked there whose prefill is not done yet
  (``queued_prefix``). The instance works first come, first served, so a request queued behind them
  reuses their KV; the KV index learns of it only when they finish. Without this, the next turn of a
  conversation that arrives while the previous one is still queued looks like a cache miss everywhere:
  the Conductor predicts a full prefill behind the queue (T_queue and TTFT too long, requests refused
  that would have met the SLO) and may send it to an idle instance that recomputes the prefix.
  Block hashes are chained (block i's hash stands for the whole prompt up to it), so a prompt's leading
  blocks held by a queued one are found by binary search against each queued prompt's hashes: a booking
  costs nothing per block, where a counter of every queued hash cost 3 ms per 100k-token prefill.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from scheduler.candidates import Resident

OVERDUE_S = 1e-3  # a request decoding past its expected end is expected to leave right after now


def request_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a decode instance reserves for a whole request (prompt + max_tokens)."""
    return math.ceil((num_prompt_tokens + max_tokens) / block_size)


@dataclass
class Booking:
    """One request's footprint on an instance; absolute times in seconds."""

    assigned_at: float
    predicted_prefill_s: float  # its own prefill time (on a prefill instance; 0 once done)
    context_tokens: int
    num_blocks: int
    expected_join: float = 0.0  # assignment + predicted TTFT
    expected_decode_s: float = 0.0  # expected output tokens x predicted TBT
    decode_started: float | None = None
    new_tokens: int = 0  # prompt tokens its prefill computes (the rest is reused)
    prompt_blocks: Sequence[Hashable] = ()  # chained hashes of the prompt's full blocks (cached after its prefill)
    # On a colocated instance: the steps of its decode that prompts prefilled there stall, booked as they were
    # (steps, seconds longer each): its TBT, the mean of its longest gaps, feels them.
    stalls: tuple[tuple[int, float], ...] = ()

    def progress(self, now: float, tokens_out: int, expected_tokens: int) -> None:
        """``tokens_out`` output tokens are out by ``now`` of the ``expected_tokens`` it is now expected to produce.

        The first one starts the decode; the tokens still expected take the request's measured pace so far.
        """
        if self.decode_started is None:
            self.decode_started = now
        if tokens_out < 2:
            return
        elapsed = now - self.decode_started
        left = max(expected_tokens - tokens_out, 0)
        self.expected_decode_s = elapsed + left * elapsed / (tokens_out - 1)

    def resident(self, now: float) -> Resident:
        """The request as part of a decode batch, relative to ``now``."""
        if self.decode_started is None:  # not decoding yet, even if its prefill runs late
            join = max(OVERDUE_S, self.expected_join - now)
            return Resident(join, join + self.expected_decode_s, self.context_tokens, self.stalls)
        join = self.decode_started - now
        return Resident(join, max(OVERDUE_S, join + self.expected_decode_s), self.context_tokens, self.stalls)


class Bookings:
    """An instance's bookings, by request id."""

    def __init__(self) -> None:
        self.items: dict[Hashable, Booking] = {}
        self.num_blocks = 0
        self._busy_until = 0.0
        self._pending: dict[Hashable, float] = {}  # predicted seconds of prefills not done, oldest (running) first
        self._pending_s = 0.0

    def add(self, request_id: Hashable, booking: Booking) -> None:
        """Book a request; its prefill (if any) queues behind the work already booked."""
        self.items[request_id] = booking
        self.num_blocks += booking.num_blocks
        if booking.predicted_prefill_s:
            self._busy_until = max(self._busy_until, booking.assigned_at) + booking.predicted_prefill_s
            self._pending[request_id] = booking.predicted_prefill_s
            self._pending_s += booking.predicted_prefill_s

    def prefill_done(self, request_id: Hashable, now: float) -> None:
        """Its prefill finished (or failed): the next in line starts now."""
        booking = self.items.get(request_id)
        if booking is None or not booking.predicted_prefill_s:
            return
        booking.predicted_prefill_s = 0.0
        booking.prompt_blocks = ()  # cached now (the KV index's to report); not held for the rest of the request
        self._pending_s -= self._pending.pop(request_id, 0.0)
        if not self._pending:
            self._pending_s = 0.0  # no rounding left over once the queue is empty
        self._busy_until = now + self._pending_s

    def remove(self, request_id: Hashable, now: float) -> None:
        """Forget a request (finished, failed or cancelled)."""
        self.prefill_done(request_id, now)
        booking = self.items.pop(request_id, None)
        if booking is not None:
            self.num_blocks -= booking.num_blocks

    def t_queue(self, now: float) -> float:
        """Predicted seconds of prefill work ahead of a request arriving now."""
        return max(0.0, self._busy_until - now, self._behind())

    def t_running(self, now: float) -> float:
        """Predicted seconds left of the prefill running now (the oldest not done), 0 when none."""
        return max(0.0, self._busy_until - now - self._behind())

    def _behind(self) -> float:
        """Predicted seconds of the prefills waiting behind the running one (0 with nothing queued)."""
        return self._pending_s - next(iter(self._pending.values()), 0.0)

    def queued_prefix(self, block_hashes: Sequence[Hashable]) -> int:
        """Leading blocks of a prompt (its chained hashes) that a prefill booked here and not done computes."""
        longest = 0
        for request_id in self._pending:
            queued = self.items[request_id].prompt_blocks
            longest = max(longest, common_prefix(queued, block_hashes, longest))
        return longest

    def in_prefill(self) -> tuple[int, int]:
        """(requests whose prefill is still queued or running, the tokens they have left to compute)."""
        if not self.items:  # most instances of a large cluster, at every decision
            return 0, 0
        waiting = [b for b in self.items.values() if b.predicted_prefill_s > 0]
        return len(waiting), sum(b.new_tokens for b in waiting)

    def residents(self, now: float) -> tuple[Resident, ...]:
        """The decode batch as the policy sees it."""
        if not self.items:
            return ()
        return tuple(b.resident(now) for b in self.items.values())

    def __len__(self) -> int:
        return len(self.items)


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable], at_least: int = 0) -> int:
    """Leading blocks two prompts' chained hashes share (``at_least`` when they share no more than that).

    Chained: once a block differs, every later one does, so the boundary is found by binary search.
    """
    n = min(len(a), len(b))
    if n <= at_least or a[at_least] != b[at_least]:
        return at_least
    lo, hi = at_least + 1, n  # a[lo - 1] == b[lo - 1]; the boundary is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
