"""Live vs. simulator: one slice of a Mooncake trace through ``bench.sim`` and a live emulated cluster.

    python -m bench.scale.live_vs_sim                                 # 200 requests, 8P+8D, 3 policies
    python -m bench.scale.live_vs_sim --limit 400 --policies kvcache_centric,cache_aware,random,round_robin
    python -m bench.scale.live_vs_sim --out bench/results/scale      # update the committed table

Both sides get the same requests (the trace's first ``--limit``, outputs capped at
``--max-output-tokens`` so that 16 workers' token streams fit on two cores; prompts at full length),
the same analytic A800 profile (``deploy/emulated.toml``: the emulated engine waits what the simulator
charges, and its transfers take the profile's link time), the same instance counts and the live engines'
KV block as the grain of prefix reuse inside a partly shared trace block, with SLO
admission off (every request is served, as ``bench.sim.run`` does by default). Per policy: mean and
p50/p90 TTFT and the prefix hit rate (reused prompt tokens / prompt tokens) on each side, and the
live/sim ratio; for each live cluster, every process's RSS at the end of the replay and its CPU use (cores)
during it. Writes ``live_vs_sim.{json,md}`` and the trace slice under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import REPO, git_state
from bench.scale.trace_slice import add_slice_arguments, prepare, replay_args
from bench.serve.cli import run_benchmark
from bench.serve.runner import Target
from bench.sim.common import run_one
from bench.soak.probe import cluster_processes, cpu_seconds, rss_kib
from cli.local_cluster import TINY_MODEL, local_cluster
from scheduler.profiles import analytic_gpu
from scheduler.sim.simulator import SimConfig
from services.common.config import load_config

LIVE_POLICIES = ("kvcache_centric", "cache_aware", "least_loaded", "random", "round_robin", "dynamo", "sglang")
TOLERANCE = 0.15  # the agreement the comparison asks for (relative, on mean TTFT and hit rate)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale.live_vs_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_slice_arguments(p)
    p.add_argument("--policies", default="kvcache_centric,cache_aware,round_robin",
                   help=f"comma-separated, of: {', '.join(LIVE_POLICIES)}")  # fmt: skip
    p.add_argument("--prefill", type=int, default=8, help="prefill instances (default 8)")
    p.add_argument("--decode", type=int, default=8, help="decode instances (default 8)")
    p.add_argument("--config", default=str(REPO / "deploy/emulated.toml"), help="the live cluster's config")
    p.add_argument("--quiet", action="store_true", help="no per-request progress line")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = sorted(set(args.policies) - set(LIVE_POLICIES))
    if unknown:
        p.error(f"unknown policies: {', '.join(unknown)}")
    if args.limit < 1 or args.max_output_tokens < 1:
        p.error("--limit and --max-output-tokens must be >= 1")
    return args


def simulated(policy: str, args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    """Mean and percentile TTFT (s) and hit rate of one policy in the simulator."""
    engine_block = load_config(args.config).block_size  # the live prefix cache's grain, for partial trace blocks
    config = SimConfig(policy=policy, num_prefill=args.prefill, num_decode=args.decode, reject=False,
                       cache_block_tokens=engine_block)  # fmt: skip
    s = run_one(config, analytic_gpu(), trace, None, 1.0)["summary"]
    t = s["ttft"]
    return {"ttft_mean": t["mean"], "ttft_p50": t["p50"], "ttft_p90": t["p90"], "hit_rate": s["cache_hit_rate"],
            "completed": s["served"]}  # fmt: skip


def live(policy: str, args: argparse.Namespace, trace: Path, run_dir: Path) -> dict[str, Any]:
    """The same on a live emulated cluster: the trace replayed at its own arrival times."""
    overrides = [*TINY_MODEL, 'engine.backend="emulated"', f'scheduler.policy="{policy}"',
                 "scheduler.reject_on_slo_violation=false", f"prefill.node_count={args.prefill}",
                 f"decode.node_count={args.decode}", "colocated.node_count=0"]  # fmt: skip
    print(f"[live_vs_sim] {policy}: starting {args.prefill}P+{args.decode}D emulated ...", file=sys.stderr, flush=True)
    with local_cluster(args.config, overrides, run_dir) as cluster:
        print(f"[live_vs_sim] {policy}: ready in {cluster.startup_s:.0f} s", file=sys.stderr, flush=True)
        bench = replay_args(trace, args.max_output_tokens)
        processes = cluster_processes(cluster.manifest, cluster.process.pid)
        cpu_before, t0 = {key: cpu_seconds(p["pid"]) for key, p in processes.items()}, time.monotonic()
        record = run_benchmark(Target(cluster.rest, "tiny-llama", None, "completions"), bench, quiet=args.quiet)
        footprint = footprint_of(processes, cpu_before, time.monotonic() - t0)
    s = record["summary"]
    t = s["ttft_ms"]
    return {"ttft_mean": t["mean"] / 1e3, "ttft_p50": t["median"] / 1e3, "ttft_p90": t["p90"] / 1e3,
            "hit_rate": s["prefix_cache_hit_rate"], "completed": s["completed"], "errors": s["errors"],
            "run_dir": str(run_dir), "footprint": footprint}  # fmt: skip


def footprint_of(processes: dict[str, dict[str, Any]], cpu_before: dict[str, float], seconds: float) -> dict[str, Any]:
    """RSS (MiB, at the end of the replay) and CPU use (cores, over it) of every process, and their totals."""
    rows = {}
    for key, p in processes.items():
        rss = rss_kib(p["pid"])
        rows[key] = {"role": p["role"], "rss_mib": (rss or 0) / 1024,
                     "cpu_cores": (cpu_seconds(p["pid"]) - cpu_before[key]) / seconds}  # fmt: skip
    total = {key: sum(r[key] for r in rows.values()) for key in ("rss_mib", "cpu_cores")}
    return {"replay_s": seconds, "processes": rows, "total": total}


def footprint_table(footprint: dict[str, Any]) -> str:
    """Per role: processes, mean and total RSS (MiB), CPU use (cores) during the replay."""
    roles: dict[str, list[dict[str, Any]]] = {}
    for row in footprint["processes"].values():
        roles.setdefault(row["role"], []).append(row)
    lines = ["| role | processes | RSS MiB each (mean) | RSS MiB total | CPU cores |", "|---|---:|---:|---:|---:|"]
    for role, rows in sorted(roles.items()):
        rss = [r["rss_mib"] for r in rows]
        lines.append(f"| {role} | {len(rows)} | {sum(rss) / len(rss):.0f} | {sum(rss):.0f} | "
                     f"{sum(r['cpu_cores'] for r in rows):.2f} |")  # fmt: skip
    t = footprint["total"]
    lines.append(f"| all | {len(footprint['processes'])} | | {t['rss_mib']:.0f} | {t['cpu_cores']:.2f} |")
    return "\n".join(lines) + "\n"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        "| policy | sim mean TTFT s | live mean TTFT s | live/sim | sim p90 s | live p90 s | sim hit | live hit "
        "| live/sim | within 15% |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for policy, r in rows.items():
        sim, real = r["sim"], r["live"]
        t, h = ratio(real["ttft_mean"], sim["ttft_mean"]), ratio(real["hit_rate"], sim["hit_rate"])
        ok = abs(t - 1) <= TOLERANCE and abs(h - 1) <= TOLERANCE
        lines.append(f"| {policy} | {sim['ttft_mean']:.3f} | {real['ttft_mean']:.3f} | {t:.2f} | {sim['ttft_p90']:.3f} "
                     f"| {real['ttft_p90']:.3f} | {sim['hit_rate']:.1%} | {real['hit_rate']:.1%} | {h:.2f} | "
                     f"{'yes' if ok else 'no'} |")  # fmt: skip
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, t0 = git_state(), time.monotonic()
    out, trace, n = prepare(args, "live-vs-sim")
    root = REPO / "runs" / f"live-vs-sim-{time.strftime('%Y%m%d-%H%M%S')}"
    rows: dict[str, dict[str, Any]] = {}
    for policy in args.policies:
        rows[policy] = {"sim": simulated(policy, args, trace), "live": live(policy, args, trace, root / policy)}
        print(table({policy: rows[policy]}).splitlines()[-1], file=sys.stderr, flush=True)
    command = "python -m bench.scale.live_vs_sim " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = {"kind": "live_vs_sim", "code": code, "command": command, "wall_s": time.monotonic() - t0,
              "trace": str(args.trace), "requests": n, "max_output_tokens": args.max_output_tokens,
              "instances": {"prefill": args.prefill, "decode": args.decode}, "profile": "analytic-gpu",
              "policies": rows}  # fmt: skip
    (out / "live_vs_sim.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "live_vs_sim.md").write_text(
        f"Live emulated cluster vs. `bench.sim`: {n} requests of `{args.trace.name}` (outputs capped at "
        f"{args.max_output_tokens} tokens), {args.prefill}P+{args.decode}D, analytic-gpu profile, no SLO admission; "
        f"code {code}; `{command}`\n\n{table(rows)}\n"
        + "".join(
            f"Footprint of the live {policy} cluster during its {r['live']['footprint']['replay_s']:.0f} s "
            f"replay:\n\n{footprint_table(r['live']['footprint'])}\n"
            for policy, r in rows.items()
        )
    )
    print(table(rows))
    print(f"wrote {out}/live_vs_sim.{{json,md}} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
