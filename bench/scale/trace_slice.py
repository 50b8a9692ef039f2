"""The trace slice the scale benchmarks replay: a Mooncake trace's first requests, outputs capped.

Standard library only (with this repository's pure modules), so that benchmarks running in another
virtual environment (Dynamo's replay) cut the same slice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.provenance import fresh_out
from scheduler.sim.trace import DEFAULT_TRACE


def write_slice(trace: Path, limit: int, max_output: int, path: Path) -> int:
    """The first ``limit`` requests with outputs capped at ``max_output`` tokens, written to ``path``; the count."""
    lines: list[str] = []
    with trace.open() as f:
        for line in f:
            if len(lines) >= limit:
                break
            if line.strip():
                row = json.loads(line)
                row["output_length"] = max(1, min(int(row["output_length"]), max_output))
                lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def replay_args(trace: Path, max_output_tokens: int) -> argparse.Namespace:
    """``bench serve``'s settings for a slice replayed at its own arrival times, every prompt whole."""
    return argparse.Namespace(
        workload="trace", trace=str(trace), limit=None, length_scale=1.0, output_scale=1.0,
        max_output_tokens=max_output_tokens, max_input_tokens=1 << 30, time_scale=1.0, seed=0,
        endpoint="completions", concurrency=None, request_rate=None, ttft_slo_ms=30000.0, tpot_slo_ms=None,
        tbt_slo_ms=300.0,
    )  # fmt: skip


def add_slice_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that choose the slice and where the results go."""
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--limit", type=int, default=200, help="the trace's first N requests (default 200)")
    p.add_argument("--max-output-tokens", type=int, default=32, help="cap on each output (default 32)")
    p.add_argument("--out", type=Path, help="results folder (default: a fresh folder under runs/bench/)")


def prepare(args: argparse.Namespace, kind: str) -> tuple[Path, Path, int]:
    """The results folder (``--out`` or a fresh one for ``kind``), the slice written there, its request count."""
    out = Path(args.out or fresh_out(kind))
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace_slice.jsonl"
    return out, trace, write_slice(args.trace, args.limit, args.max_output_tokens, trace)
