"""Policy study: replay a Mooncake trace through every policy in the simulator.

    python -m bench.sim.run                          # full conversation trace, analytic GPU profile, 10P+6D
    python -m bench.sim.run --limit 2000 --policies kvcache_centric,random

Writes ``policies.json``, ``policies.png`` and ``policies.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import fresh_out, git_state
from bench.sim.common import add_common_options, make_profile, run_all, write_json
from bench.sim.plots import plot_policies
from scheduler.sim.simulator import SIM_POLICIES, SimConfig

# Mooncake FAST'25 Figure 5: average TTFT (s), conversation trace, 16 nodes.
PAPER_FIG5 = {"kvcache_centric": 3.07, "cache_aware": 3.58, "least_loaded": 5.27, "random": 19.65}
RAW = ("ttft_s", "tbt_s", "samples", "rejections_at")  # per-request arrays: in the plot, not the JSON
PAPER_NAMES = {
    "kvcache_centric": "global cache-aware (ours, Algorithm 1)",
    "cache_aware": "local cache-aware",
    "least_loaded": "load-balancing",
    "random": "random",
    "round_robin": "round-robin",
    "dynamo": "Dynamo KV-router rule",
    "sglang": "SGLang cache-aware rule",
    "colocated": "colocated (vLLM-like)",
    "conditional": "conditional (prefill local or remote by cost)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.run", description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument(
        "--policies", default=",".join(SIM_POLICIES), help="comma-separated, of: " + ", ".join(SIM_POLICIES)
    )
    parser.add_argument("--speed", type=float, default=1.0, help="time compression (2 = twice as fast)")
    parser.add_argument("--reject", action="store_true", help="SLO admission on (off: every request is served)")
    parser.add_argument("--name", default="policies", help="file name stem of the outputs")
    return parser.parse_args(argv)


def table(runs: dict[str, dict[str, Any]]) -> str:
    head = (
        "| policy | mean TTFT s | p50 | p90 | p99 | paper Fig. 5 mean TTFT s | mean TBT ms | p99 TBT ms | "
        "SLO TBT<=100/200/300 ms | prefix hit | KV copied GB | rejected |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n"
    )
    rows = []
    for policy, run in runs.items():
        s = run["summary"]
        t, b = s["ttft"], s["tbt"]
        slo = " / ".join(f"{v:.1%}" for v in s["slo_attainment"].values())
        paper = f"{PAPER_FIG5[policy]:.2f}" if policy in PAPER_FIG5 else ""
        rows.append(
            f"| {PAPER_NAMES.get(policy, policy)} | {t['mean']:.2f} | {t['p50']:.2f} | {t['p90']:.2f} | "
            f"{t['p99']:.2f} | {paper} | {b['mean'] * 1e3:.1f} | {b['p99'] * 1e3:.1f} | {slo} | "
            f"{s['cache_hit_rate']:.1%} | {s['kv_copy_bytes'] / 1e9:.0f} | {sum(s['rejections'].values())} |"
        )
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = git_state()  # before this run writes anything into the tree
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(SIM_POLICIES))
    if unknown:
        print(f"unknown policies: {', '.join(unknown)}", file=sys.stderr)
        return 2
    profile = make_profile(args)
    configs = [
        SimConfig(
            policy=p,
            num_prefill=args.prefill,
            num_decode=args.decode,
            max_ttft=args.max_ttft,
            max_tbt=args.max_tbt,
            reject=args.reject,
            kv_cache_balancing_threshold=args.threshold,
            disaggregation=args.disaggregation,
            seed=args.seed,
            prediction_error=args.prediction_error,
        )
        for p in policies
    ]
    t0 = time.perf_counter()
    results = run_all(configs, profile, args, args.speed)
    wall = time.perf_counter() - t0
    runs = dict(zip(policies, results, strict=True))
    args.out = args.out or Path(fresh_out("sim"))
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.name}.png"
    plot_policies(runs, PAPER_FIG5, png, f"{profile.name}; {args.prefill}P+{args.decode}D; speed x{args.speed}")
    record = {
        "command": "python -m bench.sim.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "code": code,
        "trace": str(args.trace),
        "speed": args.speed,
        "profile": profile.to_dict(),
        "wall_s_total": wall,
        "paper_figure5_mean_ttft_s": PAPER_FIG5,
        "peer_rules_note": "dynamo and sglang are prefill rules of ConductorPolicy (scheduler/rules.py), as live: "
        "they pick the prefill instance, decode choice and admission are the Conductor's; colocated runs Algorithm 1 "
        "over colocated instances with no transfers",
        "policies": {
            p: {k: v for k, v in r.items() if k not in ("ttft_s", "tbt_s", "samples")} for p, r in runs.items()
        },
    }
    write_json(args.out / f"{args.name}.json", record)
    md = table(runs)
    (args.out / f"{args.name}.md").write_text(f"Code {record['code']}; `{record['command']}`\n\n{md}")
    print(md)
    print(f"wrote {args.out}/{args.name}.json, .md, .png")
    for p, r in runs.items():
        print(f"{p:>16}: {r['wall_s']:.1f} s wall, {r['requests_per_s']:.0f} requests (policy calls) simulated per s")
    print(f"total wall time {wall:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
