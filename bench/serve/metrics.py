"""Summary statistics of a benchmark run: latency percentiles, throughput, goodput, cache hits, errors.

Definitions (all over completed requests unless said otherwise):

- TTFT: time to first token; TPOT: (end - first token) / (output tokens - 1); ITL: every gap between
  chunks, pooled over requests; E2E: end-to-end latency.
- percentiles interpolate linearly between order statistics (numpy's default), so p50 is the median.
- request throughput = completed / duration; output-token throughput = sum of output tokens / duration.
- TBT of a request: the mean of the longest 10% of its gaps (the paper's, and the simulator's:
  ``scheduler.sim.metrics.request_tbt``).
- goodput = requests that completed within every given SLO (TTFT <= ttft_slo_ms, TPOT <= tpot_slo_ms,
  TBT <= tbt_slo_ms) per second; a request with one token has no TPOT or TBT and is judged on TTFT alone.
  SLO attainment = those requests / all requests (failed and rejected ones count as misses).
- prefix-cache hit rate = sum(cached_tokens) / sum(prompt_tokens) over requests whose usage was reported.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.serve.client import RequestResult

STATS = ("median", "p90", "p99", "mean")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe(values: Sequence[float]) -> dict[str, float]:
    """median, p90, p99 and mean (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    return {
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": mean,
    }


def within_slo(
    r: RequestResult, ttft_slo_s: float | None, tpot_slo_s: float | None, tbt_slo_s: float | None = None
) -> bool:
    """Completed and within every given limit."""
    if r.error is not None or r.ttft is None:
        return False
    if ttft_slo_s is not None and r.ttft > ttft_slo_s:
        return False
    for value, limit in ((r.tpot, tpot_slo_s), (r.tbt, tbt_slo_s)):
        if limit is not None and value is not None and value > limit:
            return False
    return True


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    tbt_slo_ms: float | None = None,
) -> dict[str, Any]:
    """The summary dict written to JSON (times in ms)."""
    done = [r for r in results if r.error is None]
    ms = 1e3

    def stat(values: list[float | None]) -> dict[str, float]:
        return describe([v * ms for v in values if v is not None])

    with_usage = [r for r in done if r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    good = sum(within_slo(r, _s(ttft_slo_ms), _s(tpot_slo_ms), _s(tbt_slo_ms)) for r in results)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1 / duration_s if duration_s > 0 else math.nan
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "ttft_ms": stat([r.ttft for r in done]),
        "tpot_ms": stat([r.tpot for r in done]),
        "tbt_ms": stat([r.tbt for r in done]),
        "tbt_per_token": _share([r.gap_per_token for r in done if r.output_tokens >= 2]),
        "itl_ms": stat([gap for r in done for gap in r.itl]),
        "e2e_ms": stat([r.latency for r in done]),
        "request_throughput": len(done) * per_s,
        "output_throughput": output_tokens * per_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_cache_hit_rate": cached / prompt if prompt else math.nan,
        "slo": {"ttft_ms": ttft_slo_ms, "tpot_ms": tpot_slo_ms, "tbt_ms": tbt_slo_ms},
        "good_requests": good,
        "slo_attainment": good / len(results) if results else math.nan,
        "goodput": good * per_s,
        "errors": dict(Counter(r.error for r in results if r.error is not None).most_common()),
    }


def _share(flags: list[bool]) -> float:
    """The share of true ``flags`` (NaN for none)."""
    return sum(flags) / len(flags) if flags else math.nan


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def format_table(summary: dict[str, Any]) -> str:
    """A readable table of one summary."""
    lines = [
        f"requests {summary['requests']}  completed {summary['completed']}  failed {summary['failed']}  "
        f"duration {summary['duration_s']:.2f} s",
        f"{'metric':<10}" + "".join(f"{s:>11}" for s in STATS),
    ]
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("tbt_ms", "TBT ms"), ("itl_ms", "ITL ms"),
                       ("e2e_ms", "E2E ms")):  # fmt: skip
        lines.append(f"{label:<10}" + "".join(f"{summary[key][s]:>11.1f}" for s in STATS))
    slo = summary["slo"]
    limits = ", ".join(f"{k} <= {v:g}" for k, v in slo.items() if v is not None) or "no SLO given"
    lines += [
        f"throughput {summary['request_throughput']:.3f} req/s, {summary['output_throughput']:.1f} output tok/s",
        f"goodput    {summary['goodput']:.3f} req/s ({summary['good_requests']} requests within {limits})",
        f"prefix-cache hit rate {summary['prefix_cache_hit_rate']:.1%} "
        f"({summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens)",
    ]
    if summary["tbt_per_token"] < 1:  # NaN: no stream of two tokens
        lines.append(
            f"TBT of {summary['tbt_per_token']:.0%} of the streams from their tokens' gaps; the rest sent "
            "fewer chunks than tokens: their mean gap (TPOT) stands in"
        )
    lines += [f"error x{n}: {reason}" for reason, n in summary["errors"].items()]
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
