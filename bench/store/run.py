"""The Mooncake Store on a live emulated cluster: hit rate and TTFT with and without it (issue 14).

    python -m bench.store.run                              # 400 requests of the conversation trace, 6P+2D
    python -m bench.store.run --out bench/results/store    # update the committed results

The trace's first ``--limit`` requests (prompts at full length up to ``--max-input-tokens``, outputs capped)
replayed at their own times through a live ``deploy/emulated.toml`` cluster twice: once with the engine
pools alone, once with ``[store] enabled``. The prefill workers' engine pools together hold about
``--pool-share`` of the slice's working set (its distinct 512-token trace blocks), so most prefixes are
evicted before they come back; the Store is sized to hold all of it. Beside both runs: the slice's
infinite-cache hit rate (each prompt's leading trace blocks seen in an earlier prompt, over its tokens),
the ceiling any cache reaches. Writes ``store.json`` and ``store.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import REPO, git_state
from bench.scale.trace_slice import add_slice_arguments, prepare, replay_args
from bench.serve.cli import run_benchmark
from bench.serve.runner import Target
from cli.local_cluster import TINY_MODEL, local_cluster
from services.common.config import load_config

TRACE_BLOCK = 512  # tokens per hash_id in the Mooncake traces


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.store.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_slice_arguments(p)
    p.set_defaults(limit=400)
    p.add_argument("--max-input-tokens", type=int, default=32768, help="leave out longer prompts (default 32768)")
    p.add_argument("--prefill", type=int, default=6, help="prefill workers (default 6: the slice's load at about half)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--pool-share", type=float, default=0.1, help="engine pools / working set (default 0.1)")
    p.add_argument("--config", default=str(REPO / "deploy" / "emulated.toml"), help="the live cluster's config")
    p.add_argument("--quiet", action="store_true", help="no per-request progress line")
    return p.parse_args(argv)


def keep_short(trace: Path, max_input_tokens: int) -> int:
    """Drop the slice's prompts longer than ``max_input_tokens`` (in place); the count left."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if int(r["input_length"]) <= max_input_tokens]
    trace.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(kept)


def working_set(trace: Path) -> dict[str, float]:
    """The slice's distinct trace-block tokens, and its infinite-cache hit rate (block-weighted)."""
    seen: set[int] = set()
    reused = total = 0
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        n, blocks = int(row["input_length"]), [int(h) for h in row["hash_ids"]]
        lead = next((i for i, h in enumerate(blocks) if h not in seen), len(blocks))
        reused += min(n - 1, lead * TRACE_BLOCK)  # the last token is always computed
        total += n
        seen.update(blocks)
    return {"tokens": len(seen) * TRACE_BLOCK, "infinite_hit_rate": reused / max(1, total)}


def replay(args: argparse.Namespace, trace: Path, overrides: list[str], run_dir: Path, label: str) -> dict[str, Any]:
    """The slice through one live cluster; the summary ``bench serve`` writes."""
    print(f"[store] {label}: starting {args.prefill}P+{args.decode}D emulated ...", file=sys.stderr, flush=True)
    with local_cluster(args.config, overrides, run_dir) as cluster:
        print(f"[store] {label}: ready in {cluster.startup_s:.0f} s", file=sys.stderr, flush=True)
        bench = replay_args(trace, args.max_output_tokens)
        record = run_benchmark(Target(cluster.rest, "tiny-llama", None, "completions"), bench, quiet=args.quiet)
    s = record["summary"]
    return {"hit_rate": s["prefix_cache_hit_rate"], "ttft_mean_s": s["ttft_ms"]["mean"] / 1e3,
            "ttft_p50_s": s["ttft_ms"]["median"] / 1e3, "ttft_p90_s": s["ttft_ms"]["p90"] / 1e3,
            "completed": s["completed"], "errors": s["errors"], "run_dir": str(run_dir)}  # fmt: skip


def table(runs: dict[str, dict[str, Any]], infinite: float) -> str:
    rows = ["| cache | prefix hit | of the infinite cache's | mean TTFT s | p50 s | p90 s | completed |",
            "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        rows.append(f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate'] / infinite:.0%} | {r['ttft_mean_s']:.2f} | "
                    f"{r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['completed']} |")  # fmt: skip
    rows.append(f"| infinite (the slice's ceiling) | {infinite:.1%} | 100% | | | | |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, t0 = git_state(), time.monotonic()
    out, trace, _ = prepare(args, "store")
    n = keep_short(trace, args.max_input_tokens)
    ws = working_set(trace)
    config = load_config(args.config, [*TINY_MODEL, 'engine.backend="emulated"'])
    pool_bytes = ws["tokens"] * args.pool_share / args.prefill * config.emulation.kv_bytes_per_token
    pool_mb = max(1, math.ceil(pool_bytes / 2**20))
    segment_mb = max(16, math.ceil(ws["tokens"] * config.emulation.kv_bytes_per_token * 1.5 / args.prefill / 2**20))
    base = [*TINY_MODEL, 'engine.backend="emulated"', "scheduler.reject_on_slo_violation=false",
            f"prefill.node_count={args.prefill}", f"decode.node_count={args.decode}", "colocated.node_count=0",
            f"prefill.kv_cache_memory_mb={pool_mb}"]  # fmt: skip
    root = REPO / "runs" / f"store-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = {
        "engine pools only": replay(args, trace, base, root / "pools", "engine pools only"),
        "with the Store": replay(
            args,
            trace,
            [*base, "store.enabled=true", f"store.segment_mb={segment_mb}"],
            root / "store",
            "with the Store",
        ),  # fmt: skip
    }
    command = "python -m bench.store.run " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = {"kind": "store", "code": code, "command": command, "wall_s": time.monotonic() - t0,
              "trace": str(args.trace), "requests": n, "working_set_tokens": ws["tokens"],
              "infinite_hit_rate": ws["infinite_hit_rate"], "prefill_pool_mb": pool_mb, "segment_mb": segment_mb,
              "instances": {"prefill": args.prefill, "decode": args.decode}, "runs": runs}  # fmt: skip
    (out / "store.json").write_text(json.dumps(record, indent=2) + "\n")
    md = table(runs, ws["infinite_hit_rate"])
    (out / "store.md").write_text(
        f"{n} requests of `{args.trace.name}` (prompts up to {args.max_input_tokens} tokens, outputs capped at "
        f"{args.max_output_tokens}), {args.prefill}P+{args.decode}D emulated, working set {ws['tokens']:,} tokens, "
        f"prefill pools {pool_mb} MiB each (about {args.pool_share:.0%} of it together), Store segments "
        f"{segment_mb} MiB each; code {code}; `{command}`\n\n{md}"
    )
    print(md)
    print(f"wrote {out}/store.{{json,md}} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
