"""How many tokens a request is expected to produce, before it starts and while it streams.

A decode booking lasts the request's output tokens x TBT, and a colocated decision weighs how long a
new request keeps its place in the batch. Neither knows the true length, so both ask the completions
seen lately: a request allowed ``max_tokens`` is expected to produce the mean of their lengths, each
capped at ``max_tokens``; one that has already produced ``k`` tokens, the mean of those *longer than
k* (the mean residual life). A plain running mean would say a request past the mean is about to end,
and the Conductor would read a batch still decoding as gone.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from itertools import accumulate

WINDOW = 512  # completions remembered


class OutputLengths:
    """The lengths of the last ``window`` completions, kept sorted with their prefix sums."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._recent: deque[int] = deque()
        self._sorted: list[int] = []
        self._prefix: list[int] = [0]

    def __len__(self) -> int:
        return len(self._sorted)

    def observe(self, tokens: int) -> None:
        """A request finished with ``tokens`` output tokens."""
        self._recent.append(tokens)
        insort(self._sorted, tokens)
        if len(self._recent) > self.window:
            del self._sorted[bisect_left(self._sorted, self._recent.popleft())]
        self._prefix = list(accumulate(self._sorted, initial=0))

    def expected(self, max_tokens: int, produced: int = 0) -> int:
        """Expected output tokens of a request allowed ``max_tokens`` (0: no limit) that has ``produced``.

        None seen yet: ``max_tokens``. None seen as long as ``produced``: as many again (capped).
        """
        if max_tokens and produced >= max_tokens:
            return produced
        longer = bisect_right(self._sorted, produced)
        n = len(self._sorted) - longer
        if n == 0:
            if not produced:
                return max_tokens
            return min(max_tokens, 2 * produced) if max_tokens else 2 * produced
        capped = bisect_right(self._sorted, max_tokens) if max_tokens else len(self._sorted)
        total = self._prefix[capped] - self._prefix[longer] + (len(self._sorted) - capped) * max_tokens
        return max(produced + 1, round(total / n))
