"""Per-node caches vs a global KV pool (Mooncake FAST'25, Figures 9 and 10) in the simulator.

    python -m bench.sim.store                          # conversation trace, 10P+6D, 3M tokens of cache per node
    python -m bench.sim.store --node-cache-tokens 1000000 --out bench/results/sim

Algorithm 1 on the same trace and cluster, four ways:

- ``per-node``: each prefill node's own cache of ``--node-cache-tokens`` and nothing shared (no copies:
  the paper's local cache);
- ``per-node + copies``: the same caches, and Algorithm 1 copies a prefix from the node that holds it
  (what kvconductor does without the Store);
- ``global pool``: the nodes' cache memory pooled as the Mooncake Store (``--prefill`` x
  ``--node-cache-tokens``), written through by every prefill and read by any node over the link; each
  node keeps only a small cache of its own (``--local-tokens``);
- ``infinite``: a Store that never evicts (the trace's reuse ceiling).

Reports each run's prefix hit rate (reused / prompt tokens; the paper's is block-weighted the same way),
the share read from the Store, and mean TTFT; the global/per-node hit-rate ratio beside the paper's 2.22x.
Writes ``store.json`` and ``store.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.provenance import fresh_out, git_state
from bench.sim.common import add_common_options, make_profile, run_all, write_json
from scheduler.sim.simulator import SimConfig

PAPER_GLOBAL_OVER_LOCAL = 2.22  # Figure 10, conversation trace, 10 prefill nodes
INFINITE_TOKENS = 1 << 40
RAW = ("ttft_s", "tbt_s", "samples", "rejections_at")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.store", description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--node-cache-tokens", type=int, default=3_000_000, help="KV cache per prefill node")
    parser.add_argument("--local-tokens", type=int, default=65_536, help="a node's own cache beside the global pool")
    return parser.parse_args(argv)


def variants(args: argparse.Namespace) -> dict[str, tuple[SimConfig, int]]:
    """Each variant's config and the per-node cache it runs with."""
    base = SimConfig(num_prefill=args.prefill, num_decode=args.decode, max_ttft=args.max_ttft, max_tbt=args.max_tbt,
                     seed=args.seed, prediction_error=args.prediction_error)  # fmt: skip
    pooled = args.prefill * args.node_cache_tokens
    return {
        "per-node": (replace(base, kv_cache_balancing_threshold=math.inf), args.node_cache_tokens),
        "per-node + copies": (base, args.node_cache_tokens),
        "global pool": (replace(base, store_tokens=pooled), args.local_tokens),
        "infinite": (replace(base, store_tokens=INFINITE_TOKENS), args.local_tokens),
    }


def table(runs: dict[str, dict[str, Any]]) -> str:
    rows = ["| cache | per-node tokens | Store tokens | prefix hit | from the Store | mean TTFT s | p90 TTFT s |",
            "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, run in runs.items():
        s, c = run["summary"], run["config"]
        store = "unbounded" if c["store_tokens"] >= INFINITE_TOKENS else f"{c['store_tokens']:,}"
        rows.append(f"| {name} | {run['node_cache_tokens']:,} | {store} | {s['cache_hit_rate']:.1%} | "
                    f"{s['store_hit_rate']:.1%} | {s['ttft']['mean']:.2f} | {s['ttft']['p90']:.2f} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = git_state()
    profile = make_profile(args)
    chosen = variants(args)
    t0 = time.perf_counter()
    results = []
    for config, cache in chosen.values():  # one profile per per-node cache size
        results += run_all([config], replace(profile, prefill_cache_tokens=cache), args, 1.0)
    runs = {name: {**{k: v for k, v in r.items() if k not in RAW}, "node_cache_tokens": cache}
            for (name, (_, cache)), r in zip(chosen.items(), results, strict=True)}  # fmt: skip
    hit = {name: run["summary"]["cache_hit_rate"] for name, run in runs.items()}
    record = {
        "command": "python -m bench.sim.store " + " ".join(argv if argv is not None else sys.argv[1:]),
        "code": code,
        "trace": str(args.trace),
        "profile": profile.to_dict(),
        "wall_s_total": time.perf_counter() - t0,
        "global_over_per_node": hit["global pool"] / hit["per-node"] if hit["per-node"] else math.inf,
        "paper_global_over_local": PAPER_GLOBAL_OVER_LOCAL,
        "runs": runs,
    }
    args.out = args.out or Path(fresh_out("sim"))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "store.json", record)
    md = table(runs)
    ratio = (f"Global pool / per-node hit rate: {record['global_over_per_node']:.2f}x "
             f"(the paper's Figure 10: {PAPER_GLOBAL_OVER_LOCAL}x).\n")  # fmt: skip
    (args.out / "store.md").write_text(f"Code {code}; `{record['command']}`\n\n{md}\n{ratio}")
    print(md + "\n" + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
