"""The learned TTFT overhead: time a request spends outside the instances' cost models.

Predicted TTFT = the chosen instance's estimate (T_queue + T_transfer + T_prefill + T_send) + overhead,
where the overhead covers what no instance model sees: tokenizing, the kvmeta lookup, the decode
reservation, gRPC hops and relaying. It is learned from measured requests by these rules:

* A sample comes only from a request that found its prefill instance idle (nothing booked ahead of it),
  and is what the instances cannot account for: the measured TTFT less the time the prefill worker
  reports for the request, or, where no such report exists (the colocated path), less the instance's
  estimate. Queueing, at the instance or in a busy Conductor, never enters the overhead.
* The overhead is the median of the samples of the last ``horizon_s`` seconds (at most ``window``):
  one slow request does not move it, and without fresh samples it decays to zero.
* It is clamped to ``[0, cap_s]``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TtftOverhead:
    """Median of recent overhead samples, bounded."""

    cap_s: float
    horizon_s: float = 30.0
    window: int = 64
    _samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, seconds)

    def observe(self, now: float, seconds: float) -> None:
        """Record one request's overhead sample."""
        self._samples.append((now, seconds))
        while len(self._samples) > self.window:
            self._samples.popleft()

    def value(self, now: float) -> float:
        """The overhead to add to predictions now."""
        while self._samples and now - self._samples[0][0] > self.horizon_s:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        return min(self.cap_s, max(0.0, statistics.median(s for _, s in self._samples)))
