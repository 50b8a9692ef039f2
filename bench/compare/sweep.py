"""``bench compare --sweep``: the seed's tuning order on the disaggregated cluster, one variable at a time.

1. P/D ratio (node counts), 2. ``[scheduler] kv_cache_balancing_threshold``, 3. ``[prefill]
max_num_batched_tokens``, 4. ``[decode] max_concurrent_requests``. Each step tries a few values with the
best values of the earlier steps fixed, and keeps the value with the highest goodput (ties: lower p90
TTFT). A setting already measured (the previous step's winner) is not run again. Each value is one
cluster start (about 10-20 s here) plus one run of the workload at one concurrency level; with the
default 20 requests the whole sweep (9 cluster starts) takes about 4-6 minutes on 2 CPU cores.

The threshold only matters with two or more prefill instances (a copy needs another holder); with one
prefill instance its values measure noise.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from bench.compare.measure import measure

RATIOS = {"1P:1D": (1, 1), "2P:1D": (2, 1), "1P:2D": (1, 2)}
# (step name, config key, values tried besides the configured one)
KNOBS = [
    ("kv_cache_balancing_threshold", "scheduler.kv_cache_balancing_threshold", ("0.8", "2.0")),
    ("prefill max_num_batched_tokens", "prefill.max_num_batched_tokens", ("256", "512")),
    ("decode max_concurrent_requests", "decode.max_concurrent_requests", ("2", "8")),
]
BASE = ("colocated.node_count=0",)


def score(summary: dict[str, Any]) -> tuple[float, float]:
    """Higher is better: goodput, then the negated p90 TTFT."""
    p90 = summary["ttft_ms"]["p90"]
    return summary["goodput"], -(p90 if math.isfinite(p90) else math.inf)


def steps(args: argparse.Namespace) -> list[tuple[str, list[tuple[str, tuple[str, ...]]]]]:
    """(step, [(value label, overrides)]); each knob's first value is the configured one (no override)."""
    from services.common.config import load_config

    config = load_config(args.config, args.set)
    ratios: list[tuple[str, tuple[str, ...]]] = [
        (label, (f"prefill.node_count={p}", f"decode.node_count={d}")) for label, (p, d) in RATIOS.items()
    ]
    out: list[tuple[str, list[tuple[str, tuple[str, ...]]]]] = [("P/D ratio", ratios)]
    for step, key, values in KNOBS:
        section, name = key.split(".")
        current = getattr(getattr(config, section), name)
        out.append((step, [(f"{current} (config)", ()), *((v, (f"{key}={v}",)) for v in values)]))
    return out


def sweep(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Run the steps; return every measurement and the chosen value of each step."""
    level = max(args.concurrency)
    chosen: dict[str, tuple[str, tuple[str, ...]]] = {}
    seen: dict[tuple[str, ...], dict[str, Any]] = {}
    results = []
    for step, values in steps(args):
        rows = []
        for label, overrides in values:
            settings = {**chosen, step: (label, overrides)}
            key = tuple(o for _, os in settings.values() for o in os)
            if key not in seen:
                run_dir = root / f"sweep-{len(seen):02d}"
                seen[key] = measure(args, f"{step}={label}", [*BASE, *key], [level], run_dir)
            summary = seen[key]["levels"][f"c={level}"]["summary"]
            rows.append({"value": label, "overrides": list(key), "summary": summary,
                         "startup_s": seen[key]["startup_s"]})  # fmt: skip
        best = max(range(len(rows)), key=lambda i: score(rows[i]["summary"]))
        chosen[step] = values[best]
        print(f"[sweep] {step}: keep {values[best][0]}", file=sys.stderr, flush=True)
        results.append({"step": step, "rows": rows, "chosen": values[best][0]})
    return {"concurrency": level, "steps": results, "chosen": {k: v[0] for k, v in chosen.items()}}


def markdown(result: dict[str, Any]) -> str:
    """One table per step."""
    out = [f"Sweep at concurrency {result['concurrency']} (goodput decides; ties: lower p90 TTFT).\n"]
    for step in result["steps"]:
        out.append(f"\n### {step['step']} (kept: {step['chosen']})\n\n")
        out.append(
            "| value | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | hit rate | goodput req/s | failed |\n"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|\n")
        for row in step["rows"]:
            s = row["summary"]
            out.append(
                f"| {row['value']} | {s['ttft_ms']['median']:.1f} | {s['ttft_ms']['p90']:.1f} | "
                f"{s['tpot_ms']['median']:.2f} | {s['tpot_ms']['p90']:.2f} | {s['prefix_cache_hit_rate']:.1%} | "
                f"{s['goodput']:.2f} | {s['failed']} |\n"
            )
    return "".join(out)
