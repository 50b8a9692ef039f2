"""Shared pieces of the simulator benchmarks: CLI options, profile choice, running runs in parallel."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from scheduler.policy import DISAGGREGATION
from scheduler.profiles import GpuSpec, Profile, analytic_gpu, load_profile, measured_cpu
from scheduler.sim.metrics import summarize
from scheduler.sim.simulator import SimConfig, Simulator
from scheduler.sim.trace import DEFAULT_TRACE, load_trace


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--profile",
        choices=["analytic-gpu", "measured-cpu"],
        default="analytic-gpu",
        help="analytic-gpu: LLaMA3-70B-like on 8xA800 (the paper's model); measured-cpu: this machine's engine",
    )
    parser.add_argument("--profile-json", type=Path, help="JSON overriding profile keys (prefill/decode dicts, ...)")
    parser.add_argument("--mfu", type=float, default=GpuSpec.mfu, help="analytic-gpu: prefill model FLOPs utilisation")
    parser.add_argument("--hbm-efficiency", type=float, default=GpuSpec.bandwidth_efficiency, help="analytic-gpu")
    parser.add_argument("--link-gbps", type=float, default=GpuSpec.link_gbps, help="analytic-gpu: KV transfer link")
    parser.add_argument("--prefill", type=int, default=SimConfig.num_prefill, help="prefill instances")
    parser.add_argument("--decode", type=int, default=SimConfig.num_decode,
                        help="decode instances (colocated: prefill+decode instances; conditional: colocated ones "
                             "beside the prefill instances)")  # fmt: skip
    parser.add_argument("--max-ttft", type=float, default=SimConfig.max_ttft, help="TTFT SLO, s")
    parser.add_argument("--max-tbt", type=float, default=SimConfig.max_tbt, help="TBT SLO used for admission, s")
    parser.add_argument("--threshold", type=float, default=SimConfig.kv_cache_balancing_threshold,
                        help="kv_cache_balancing_threshold")  # fmt: skip
    parser.add_argument("--seed", type=int, default=SimConfig.seed)
    parser.add_argument(
        "--prediction-error",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="cost-model error: every job and decode step runs exp(N(0, SIGMA)) x the predicted time (default 0)",
    )
    parser.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION,
        default=SimConfig.disaggregation,
        help="the conditional policy's rule: where a request prefills (scheduler/disaggregation.py)",
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel")
    parser.add_argument(
        "--out",
        type=Path,
        help="results folder (default: a fresh folder under runs/bench/; bench/results/sim to "
        "update the committed results)",
    )


def make_profile(args: argparse.Namespace) -> Profile:
    if args.profile == "measured-cpu":
        profile = measured_cpu()
    else:
        spec = replace(GpuSpec(), mfu=args.mfu, bandwidth_efficiency=args.hbm_efficiency, link_gbps=args.link_gbps)
        profile = analytic_gpu(spec)
    return load_profile(args.profile_json, profile) if args.profile_json else profile


def run_one(config: SimConfig, profile: Profile, trace: Path, limit: int | None, speed: float) -> dict[str, Any]:
    """One simulated run in a worker process; returns a JSON-ready record."""
    requests = load_trace(trace, speed=speed, limit=limit)
    label = f"{config.policy}/{config.early_rejection}"
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"  [{label}] {done:>6}/{total} requests  ({time.perf_counter() - t0:5.1f} s)", flush=True)

    result = Simulator(config, profile, requests).run(progress)
    wall = time.perf_counter() - t0
    summary, ttft, tbt = summarize(result.records, result.step_logs, config.max_ttft)
    return {
        "config": asdict(config),
        "summary": summary.to_dict(),
        "wall_s": wall,
        "policy_calls": result.policy_calls,
        "requests_per_s": len(requests) / wall,
        "samples": result.samples,
        "ttft_s": ttft.tolist(),
        "tbt_s": tbt.tolist(),
        "rejections_at": [[r.arrival, r.rejection] for r in result.records if r.rejection],
        "instances": result.instance_stats,
    }


def run_all(configs: list[SimConfig], profile: Profile, args: argparse.Namespace, speed: float) -> list[dict[str, Any]]:
    """Every config, ``args.jobs`` at a time, in order."""
    print(f"{len(configs)} runs on {args.trace} ({'all' if args.limit is None else args.limit} requests, "
          f"speed x{speed}, {args.jobs} processes), profile {profile.name}", flush=True)  # fmt: skip
    if args.jobs <= 1:
        return [run_one(c, profile, args.trace, args.limit, speed) for c in configs]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, c, profile, args.trace, args.limit, speed) for c in configs]
        return [f.result() for f in futures]


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=float) + "\n")
    print(f"wrote {path}", file=sys.stderr)
