"""How much sooner than predicted requests start decoding: the margin the stall checks give a booked join.

A request booked to decode on an instance is expected to join its batch at its predicted TTFT. It may come
sooner: its prefill ran faster than the instance's model says, the queue ahead of it drained early. On a
colocated instance that matters: a prompt prefilled there stalls every request decoding while its chunks
run, and a request predicted to join after the prompt's last chunk (no stall booked) that joins during its
chunking takes the rest of them (``stalls.stalled_steps``). So the stall checks count a booked request's
chunks from its earliest plausible join, ``early`` seconds before the predicted one: its predicted TTFT
times the share by which recent requests came early.

One request's earliness is ``(expected join - actual join) / (expected join - assignment)``: the share of
its predicted TTFT it came early by (negative: late). The margin is the ``QUANTILE`` of the last
``WINDOW`` samples, clamped to ``[0, MAX_SHARE]``: no samples, or predictions that are never early, give 0,
and the checks are those of the predicted joins.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

WINDOW = 256  # joins remembered
QUANTILE = 0.9  # of the earliness samples: a request joins sooner than this margin says one time in ten
MAX_SHARE = 0.5  # a join is never expected more than half its predicted TTFT early


class EarlyJoins:
    """The earliness of the last ``window`` joins, kept sorted."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    def observe(self, assigned: float, expected_join: float, joined: float) -> None:
        """A request assigned at ``assigned``, expected to join at ``expected_join``, joined at ``joined``."""
        predicted = expected_join - assigned
        if predicted <= 0:
            return
        share = (expected_join - joined) / predicted
        self._recent.append(share)
        insort(self._sorted, share)
        if len(self._recent) > self.window:
            del self._sorted[bisect_left(self._sorted, self._recent.popleft())]

    def share(self) -> float:
        """The share of a predicted TTFT by which a booked join may come early."""
        if not self._sorted:
            return 0.0
        q = self._sorted[min(len(self._sorted) - 1, int(QUANTILE * len(self._sorted)))]
        return min(MAX_SHARE, max(0.0, q))
