"""Per-request records of a simulated run and their summary.

TBT follows the paper: a request's TBT is the mean of the longest 10% of its token gaps (at least
one gap). A request attains the SLO when it was served, its TTFT is within ``max_ttft`` and its TBT
within the threshold; effective request capacity is the number of such requests (rejected requests
count as misses). The prefix-cache hit rate is reused prompt tokens (local hits plus copied KV) over
the prompt tokens of served requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TBT_THRESHOLDS = (0.1, 0.2, 0.3)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; absolute simulated seconds (nan: never happened)."""

    request_id: int
    arrival: float
    num_prompt_tokens: int
    num_output_tokens: int
    prefill_instance: str = ""
    decode_instance: str = ""
    predicted_ttft: float = math.nan
    predicted_tbt: float = math.nan
    local_tokens: int = 0  # prompt tokens reused from the prefill instance's own cache
    copied_tokens: int = 0  # prompt tokens whose KV was copied from another instance (or the Store)
    store_tokens: int = 0  # of those, copied from the Mooncake Store
    copy_bytes: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    first_step: int = -1  # index of its first decode step in its decode instance's step log
    rejection: str = ""  # "ttft", "tbt" or "capacity" when rejected

    @property
    def served(self) -> bool:
        """Admitted (and, at the end of a run, finished)."""
        return not self.rejection


def request_tbt(gaps: Sequence[float] | np.ndarray) -> float:
    """A request's TBT from its token gaps: the mean of the longest 10% (at least one); 0 without gaps.

    The one definition of TBT: the simulator's records and the live benchmarks' clients both use it.
    """
    if len(gaps) == 0:
        return 0.0
    k = max(1, math.ceil(0.1 * len(gaps)))
    return float(np.partition(np.asarray(gaps, dtype=float), len(gaps) - k)[-k:].mean())


def tbt_of(record: RequestRecord, step_times: np.ndarray) -> float:
    """``request_tbt`` of a simulated request's gaps (from its decode instance's step log)."""
    steps = record.num_output_tokens - 1
    if steps <= 0 or record.first_step < 0:
        return 0.0
    times = step_times[record.first_step : record.first_step + steps]
    return request_tbt(np.diff(times, prepend=record.first_token))


def _dist(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(values.mean())}


@dataclass
class Summary:
    """The numbers reported per policy."""

    requests: int
    served: int
    rejections: dict[str, int]
    ttft: dict[str, float]
    tbt: dict[str, float]
    slo_attainment: dict[str, float]  # keyed "tbt<=100ms" etc., over all requests
    effective_capacity: dict[str, int]
    cache_hit_rate: float
    local_hit_rate: float
    store_hit_rate: float  # prompt tokens read from the Mooncake Store / prompt tokens
    kv_copy_bytes: int
    kv_copies: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dict(self.__dict__)


def summarize(
    records: Sequence[RequestRecord], step_logs: dict[str, np.ndarray], max_ttft: float = 30.0
) -> tuple[Summary, np.ndarray, np.ndarray]:
    """The summary plus per-served-request TTFT and TBT arrays (for plots)."""
    served = [r for r in records if r.served and not math.isnan(r.first_token)]
    ttft = np.array([r.first_token - r.arrival for r in served])
    tbt = np.array([tbt_of(r, step_logs.get(r.decode_instance, np.empty(0))) for r in served])
    rejections: dict[str, int] = {}
    for r in records:
        if r.rejection:
            rejections[r.rejection] = rejections.get(r.rejection, 0) + 1
    attainment: dict[str, float] = {}
    capacity: dict[str, int] = {}
    for threshold in TBT_THRESHOLDS:
        key = f"tbt<={threshold * 1e3:.0f}ms"
        capacity[key] = int(np.sum((ttft <= max_ttft) & (tbt <= threshold)))
        attainment[key] = capacity[key] / max(1, len(records))
    prompt = sum(r.num_prompt_tokens for r in served)
    local = sum(r.local_tokens for r in served)
    copied = sum(r.copied_tokens for r in served)
    summary = Summary(
        requests=len(records),
        served=len(served),
        rejections=rejections,
        ttft=_dist(ttft),
        tbt=_dist(tbt),
        slo_attainment=attainment,
        effective_capacity=capacity,
        cache_hit_rate=(local + copied) / max(1, prompt),
        local_hit_rate=local / max(1, prompt),
        store_hit_rate=sum(r.store_tokens for r in served) / max(1, prompt),
        kv_copy_bytes=sum(r.copy_bytes for r in served),
        kv_copies=sum(1 for r in served if r.copied_tokens),
    )
    return summary, ttft, tbt
