"""``kvconductor bench serve``: flags, workload construction, the run, the table and the JSON.

    kvconductor bench serve --base-url http://127.0.0.1:8000/v1 --model tiny-llama \\
        --workload shared-prefix --num-prefixes 2 --suffixes-per-prefix 10 --out serve.json
    kvconductor bench serve --base-url URL --model tiny-llama --workload trace --limit 200 \\
        --length-scale 0.03125 --time-scale 0.1

Pacing: ``--concurrency C`` (closed loop) wins over ``--request-rate R`` (Poisson); without either,
trace replay follows the trace's timestamps and the other workloads run one request at a time (the
seed's procedure: sequential streaming requests, medians over about 20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import command_line, fresh_out, git_state
from bench.serve import metrics
from bench.serve.runner import Target, check_target, run
from bench.serve.workloads import DEFAULT_TRACE, BenchRequest, TraceScale, load_trace, random_lengths, shared_prefix


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench serve`` (shared with ``bench compare``'s workload options)."""
    p.add_argument("--base-url", required=True, help="OpenAI-compatible base URL ending in /v1")
    p.add_argument("--model", required=True, help="the model field of every request")
    p.add_argument("--api-key", help="bearer key, if the server wants one")
    p.add_argument("--out", help="JSON to write, the summary as .md beside it (default: a new folder in runs/bench/)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    add_workload_arguments(p)
    pace = p.add_argument_group("pacing and SLO")
    pace.add_argument("--concurrency", type=int, help="closed loop with this many requests in flight")
    pace.add_argument("--request-rate", type=float, help="open loop, Poisson arrivals at this rate (req/s)")
    add_slo_arguments(pace)


def add_slo_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "none") -> None:
    """``--ttft-slo-ms``, ``--tpot-slo-ms``, ``--tbt-slo-ms``: goodput's limits (``default``: what unset means)."""
    p.add_argument("--ttft-slo-ms", type=float, help=f"goodput: TTFT limit in ms (default {default})")
    p.add_argument("--tpot-slo-ms", type=float, help="goodput: limit in ms on a request's mean time per output token")
    p.add_argument("--tbt-slo-ms", type=float,
                   help="goodput: limit in ms on a request's TBT, the mean of its longest 10%% of token gaps "
                   f"(default {default})")  # fmt: skip


def add_workload_arguments(p: argparse.ArgumentParser, requests_flag: str = "--num-requests") -> None:
    """The workload flags (``requests_flag`` names the request-count flag)."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["shared-prefix", "random", "trace"], default="shared-prefix")
    w.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="chat sends the prompt as text, completions as token ids (default chat)",
    )
    w.add_argument(
        requests_flag,
        dest="num_requests",
        type=int,
        default=20,
        help="requests (shared-prefix: N x M with M = this / N; default 20)",
    )
    w.add_argument("--num-prefixes", type=int, default=2, help="shared-prefix: distinct prefixes (N)")
    w.add_argument(
        "--suffixes-per-prefix", type=int, help="shared-prefix: suffixes per prefix (M; default: --num-requests / N)"
    )
    w.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: prefix tokens (default 512)")
    w.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: suffix tokens (default 32)")
    w.add_argument("--output-len", type=int, default=32, help="shared-prefix: output tokens (default 32)")
    w.add_argument("--input-range", type=_range, default=(64, 512), metavar="LO:HI", help="random: prompt tokens")
    w.add_argument("--output-range", type=_range, default=(8, 64), metavar="LO:HI", help="random: output tokens")
    w.add_argument("--trace", default=DEFAULT_TRACE, help="trace: Mooncake JSONL file")
    w.add_argument("--limit", type=int, default=100, help="trace: first N requests (default 100)")
    w.add_argument(
        "--length-scale",
        type=float,
        default=1 / 32,
        help="trace: real tokens per trace token (default 1/32: a 512-token block -> 16 tokens)",
    )
    w.add_argument(
        "--output-scale", type=float, help="trace: real output tokens per trace token (default: --length-scale)"
    )
    w.add_argument("--max-output-tokens", type=int, default=64, help="trace: cap on scaled outputs (default 64)")
    w.add_argument("--max-input-tokens", type=int, default=2048, help="trace: cap on scaled prompts (default 2048)")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace: seconds of replay per trace second")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts and Poisson arrivals (default 0)")


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests the flags describe."""
    if args.workload == "shared-prefix":
        per_prefix = args.suffixes_per_prefix or max(1, args.num_requests // max(1, args.num_prefixes))
        return shared_prefix(
            args.num_prefixes, per_prefix, args.prefix_len, args.suffix_len, args.output_len, args.seed
        )
    if args.workload == "random":
        return random_lengths(args.num_requests, args.input_range, args.output_range, args.seed)
    scale = TraceScale(
        args.length_scale, args.output_scale, args.max_output_tokens, args.max_input_tokens, args.time_scale, args.seed
    )
    return load_trace(args.trace, args.limit, scale)


def pacing(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """(concurrency, rate) after the defaults described in the module docstring."""
    for name in ("concurrency", "request_rate"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.concurrency or args.request_rate or args.workload == "trace":
        return args.concurrency, args.request_rate
    return 1, None


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    """The workload and pacing flags, for the JSON record."""
    keys = [k for k in vars(args) if k not in ("base_url", "api_key", "out", "quiet", "func", "command")]
    return {k: getattr(args, k) for k in sorted(keys) if not callable(getattr(args, k))}


def run_benchmark(target: Target, args: argparse.Namespace, quiet: bool = False) -> dict[str, Any]:
    """Build the workload, check the server, run, summarize; the JSON record."""
    requests = build_workload(args)
    concurrency, rate = pacing(args)
    asyncio.run(check_target(target))
    results, duration = asyncio.run(run(target, requests, concurrency, rate, args.seed, quiet))
    summary = metrics.summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms, args.tbt_slo_ms)
    return {
        "target": {"base_url": target.base_url, "model": target.model, "endpoint": target.endpoint},
        "config": workload_config(args),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summary,
        "requests": [vars(r) | {"tpot": r.tpot} for r in results],
    }


def main(args: argparse.Namespace) -> int:
    """Run ``bench serve``; 0 on success, 1 on a clear error (printed in one line)."""
    target = Target(args.base_url.rstrip("/"), args.model, args.api_key, args.endpoint)
    try:
        record = run_benchmark(target, args, args.quiet)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    table = metrics.format_table(record["summary"])
    print(table)
    out = Path(args.out) if args.out else Path(fresh_out("serve")) / "serve.json"
    record = {"kind": "serve", "code": git_state(), "command": command_line(), **record}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(metrics.jsonable(record), indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(f"`{record['command']}` (code {record['code']})\n\n```\n{table}\n```\n")
    print(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.serve.cli", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
