"""One measurement: start a cluster with some overrides, run the workload at each concurrency, stop it.

Every concurrency level gets its own prompts (seed + level index), so a later level does not find the
prompts of an earlier one in the prefix cache: each level starts as cold as the first.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serve.cli import run_benchmark
from bench.serve.runner import Target
from cli.local_cluster import local_cluster


def measure(
    args: argparse.Namespace, name: str, overrides: Sequence[str], levels: Sequence[int], run_dir: Path
) -> dict[str, Any]:
    """Records per level (``{"c=4": record}``) plus the cluster's start-up time and overrides."""
    print(f"[compare] starting {name} cluster ({' '.join(overrides)}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    records: dict[str, Any] = {}
    with local_cluster(args.config, [*args.model_overrides, *args.set, *overrides], run_dir) as cluster:
        print(f"[compare] {name} ready in {cluster.startup_s:.1f} s at {cluster.rest}", file=sys.stderr, flush=True)
        target = Target(cluster.rest, args.model, None, args.endpoint)
        for i, level in enumerate(levels):
            level_args = argparse.Namespace(**{**vars(args), "concurrency": level, "request_rate": None,
                                               "seed": args.seed + i})  # fmt: skip
            record = run_benchmark(target, level_args, quiet=args.quiet)
            records[f"c={level}"] = record
            s = record["summary"]
            print(
                f"[compare] {name} c={level}: TTFT p50 {s['ttft_ms']['median']:.1f} ms, "
                f"TPOT p50 {s['tpot_ms']['median']:.2f} ms, hit {s['prefix_cache_hit_rate']:.1%}",
                file=sys.stderr,
                flush=True,
            )
        startup = cluster.startup_s
    return {
        "overrides": [*args.set, *overrides],
        "startup_s": startup,
        "wall_s": time.monotonic() - t0,
        "run_dir": str(run_dir),
        "levels": records,
    }
