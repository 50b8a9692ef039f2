"""How far the cost models' predictions are from what happened: per metric, recent requests.

The relative error of one prediction is ``|predicted - actual| / actual``; the summary is the median
over a window of recent requests, per metric (TTFT, TBT, KV send, KV copy).
"""

from __future__ import annotations

import statistics
from collections import deque

from kvconductor.v1 import conductor_pb2
from services.metrics import PREDICTION_ERROR

METRICS = ("ttft", "tbt", "kv_send", "kv_copy")


class PredictionErrors:
    """Windows of (predicted, actual) pairs."""

    def __init__(self, window: int = 1000) -> None:
        self._pairs: dict[str, deque[tuple[float, float]]] = {m: deque(maxlen=window) for m in METRICS}

    def record(self, metric: str, predicted: float, actual: float) -> None:
        """Add one pair (seconds); ignored when nothing was measured."""
        if actual > 0:
            self._pairs[metric].append((predicted, actual))
            PREDICTION_ERROR.labels(metric).observe(abs(predicted - actual) / actual)

    def median_relative_error(self, metric: str) -> float | None:
        """Median |predicted - actual| / actual, or None without samples."""
        pairs = self._pairs[metric]
        if not pairs:
            return None
        return statistics.median(abs(p - a) / a for p, a in pairs)

    def latencies(self) -> list[conductor_pb2.LatencyPercentiles]:
        """Percentiles of the measured TTFT and TBT of recent requests."""
        out = []
        for metric in ("ttft", "tbt"):
            actual = sorted(a for _, a in self._pairs[metric])
            if actual:
                pick = [actual[min(len(actual) - 1, int(len(actual) * q))] * 1e3 for q in (0.5, 0.9, 0.99)]
                out.append(conductor_pb2.LatencyPercentiles(metric=metric, samples=len(actual), p50_ms=pick[0],
                                                            p90_ms=pick[1], p99_ms=pick[2]))  # fmt: skip
        return out

    def summary(self) -> list[conductor_pb2.PredictionError]:
        """One message per metric with samples."""
        out = []
        for metric, pairs in self._pairs.items():
            error = self.median_relative_error(metric)
            if error is not None:
                out.append(
                    conductor_pb2.PredictionError(metric=metric, samples=len(pairs), median_relative_error=error)
                )
        return out
