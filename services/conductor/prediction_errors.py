"""How far the cost models' predictions are from what happened: per metric, recent requests.

The relative error of one prediction is ``|predicted - actual| / actual``; the summary is the median
over the requests of a recent time window (at most the last 1,000), per metric (TTFT, TBT, KV send,
KV copy).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from kvconductor.v1 import conductor_pb2
from services.common.metrics import PREDICTION_ERROR

METRICS = ("ttft", "tbt", "kv_send", "kv_copy")
DEFAULT_WINDOW_S = 300.0


class PredictionErrors:
    """Windows of (time, predicted, actual) triples."""

    def __init__(self, window: int = 1000) -> None:
        self._pairs: dict[str, deque[tuple[float, float, float]]] = {m: deque(maxlen=window) for m in METRICS}

    def record(self, metric: str, predicted: float, actual: float) -> None:
        """Add one pair (seconds); ignored when nothing was measured."""
        if actual > 0:
            self._pairs[metric].append((time.monotonic(), predicted, actual))
            PREDICTION_ERROR.labels(metric).observe(abs(predicted - actual) / actual)

    def pairs(self, metric: str, window_s: float = DEFAULT_WINDOW_S) -> list[tuple[float, float]]:
        """(predicted, actual) of the requests recorded in the last ``window_s`` seconds."""
        since = time.monotonic() - window_s
        return [(p, a) for t, p, a in self._pairs[metric] if t >= since]

    def median_relative_error(self, metric: str, window_s: float = DEFAULT_WINDOW_S) -> float | None:
        """Median |predicted - actual| / actual, or None without samples."""
        pairs = self.pairs(metric, window_s)
        if not pairs:
            return None
        return statistics.median(abs(p - a) / a for p, a in pairs)

    def latencies(self, window_s: float = DEFAULT_WINDOW_S) -> list[conductor_pb2.LatencyPercentiles]:
        """Percentiles of the measured TTFT and TBT of recent requests."""
        out = []
        for metric in ("ttft", "tbt"):
            actual = sorted(a for _, a in self.pairs(metric, window_s))
            if actual:
                pick = [actual[min(len(actual) - 1, int(len(actual) * q))] * 1e3 for q in (0.5, 0.9, 0.99)]
                out.append(conductor_pb2.LatencyPercentiles(metric=metric, samples=len(actual), p50_ms=pick[0],
                                                            p90_ms=pick[1], p99_ms=pick[2]))  # fmt: skip
        return out

    def summary(self, window_s: float = DEFAULT_WINDOW_S) -> list[conductor_pb2.PredictionError]:
        """One message per metric with samples in the window."""
        out = []
        for metric in METRICS:
            pairs = self.pairs(metric, window_s)
            if pairs:
                error = statistics.median(abs(p - a) / a for p, a in pairs)
                out.append(
                    conductor_pb2.PredictionError(metric=metric, samples=len(pairs), median_relative_error=error)
                )
        return out
