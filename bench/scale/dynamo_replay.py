"""Dynamo's KV router on the same trace slice and profile, offline: ``dynamo.replay`` over its mocker engines.

    make dynamo                                   # once: Dynamo 1.6.1 into .venv-dynamo (see ENVIRONMENT.md)
    .venv-dynamo/bin/python -m bench.scale.dynamo_replay --limit 200
    .venv-dynamo/bin/python -m bench.scale.dynamo_replay --limit 400 --request-rates 6 9 12 15 --ttft-slo-ms 10000

Runs in Dynamo's own virtual environment (``ai-dynamo`` cannot share ours: it pins other versions) and
imports only this repository's standard-library and numpy parts. The mocker's timing is a profile table
(``.npz``) computed from the same latency profile the emulated engine and ``bench.sim`` use, so the three
see the same hardware. Matched: block size, KV capacity per worker, batch limits
(``max_num_batched_tokens``, ``max_num_seqs``), chunked prefill and prefix caching on. Different:

- the mocker looks prefill time up by the step's uncached tokens only, so the attention cost of a long
  cached context (the profile's c2 term) is not charged, which flatters every policy there a little;
- its virtual clock has no serving overheads (no RPCs) and its disaggregated mode moves KV for free;
- it admits every request (no SLO admission).

Front ends: Dynamo's ``kv_router`` and ``round_robin`` over ``--workers`` aggregated workers (each prefills
and decodes, like our colocated deployment), and ``kv_router_disagg``, its KV router over
``--prefill-workers`` prefill + the rest decode workers. Beside them, ``bench.sim`` runs our Conductor on
the same slice, profile and rates (``conductor_disagg``: Algorithm 1 with SLO admission on the same split;
``conductor``: colocated). ``--request-rates`` scales the slice's arrivals to each mean rate (as ``bench
serve --request-rate`` does a trace's); a request meets the SLO when its TTFT and its mean token gap are
within the limits (the replay reports no gaps one by one, so the mean stands in for TBT: lenient). Each
Dynamo mode runs ``--repeats`` times per rate (it breaks ties at random). Writes ``dynamo_replay.{json,md}``
and the slice under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.provenance import git_state
from bench.scale.trace_slice import add_slice_arguments, prepare
from scheduler.profiles import Profile, named_profile

MODES = ("kv_router", "round_robin", "kv_router_disagg")  # the last: --prefill-workers prefill + the rest decode
BLOCK_SIZE = 16  # the cluster's [prefill] prefix_cache_block_size
TOKENS_PER_WORKER = 186 * 2**20 // 64  # deploy/emulated.toml's colocated pool at 64 bytes a token
ISL = (1, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ACTIVE_KV = (1, 1e3, 1e4, 1e5, 3e5, 1e6, 2e6, 4e6)
CONTEXT = (1, 512, 2048, 8192, 16384, 32768, 131072)


def profile_table(profile: Profile, path: Path) -> Path:
    """The mocker's profile table of ``profile``: prefill time by new tokens, ITL by (active KV, context)."""
    itl = [[profile.decode.predict(max(1, int(kv // ctx)), int(kv)) * 1e3 for ctx in CONTEXT] for kv in ACTIVE_KV]
    np.savez(
        path,
        prefill_isl=np.array(ISL, dtype=float),
        prefill_ttft_ms=np.array([profile.prefill.predict(n, 0) * 1e3 for n in ISL]),
        decode_active_kv_tokens=np.array(ACTIVE_KV, dtype=float),
        decode_context_length=np.array(CONTEXT, dtype=float),
        decode_itl=np.array(itl),
    )
    return path


def own_rate(trace: Path) -> float:
    """The slice's mean arrival rate (req/s), as ``bench.serve.runner.arrival_times`` counts it: (n - 1) / span."""
    stamps = [float(json.loads(line)["timestamp"]) / 1e3 for line in trace.read_text().splitlines() if line.strip()]
    return (len(stamps) - 1) / (max(stamps) - min(stamps))


def replay(
    mode: str, trace: Path, table: Path, args: argparse.Namespace, profile: Profile, speedup: float
) -> dict[str, float]:
    """One offline replay at ``speedup`` x the trace's arrival rate: the summary numbers and SLO attainment kept.

    Attainment: TTFT within ``--ttft-slo-ms`` and the request's mean token gap within ``--tbt-slo-ms``; the
    replay reports no request's gaps one by one, so its mean stands in for the TBT (mean of the longest 10%)
    that judges the live contenders: a more lenient test, in Dynamo's favour.
    """
    from dynamo.llm import KvRouterConfig
    from dynamo.replay import run_trace_replay

    timing = {"type": "external", "provider": "dynamo_profile", "config": {"path": str(table)}}
    engine = {"block_size": BLOCK_SIZE, "num_gpu_blocks": TOKENS_PER_WORKER // BLOCK_SIZE,
              "max_num_seqs": profile.max_running, "max_num_batched_tokens": profile.chunk_tokens,
              "enable_prefix_caching": True, "enable_chunked_prefill": True, "timing_model": timing}  # fmt: skip
    kwargs: dict[str, Any] = {"router_config": KvRouterConfig()} if mode.startswith("kv_router") else {}
    if mode == "kv_router_disagg":
        kwargs |= {"prefill_engine_args": {"engine": {**engine, "worker_type": "prefill"}},
                   "decode_engine_args": {"engine": {**engine, "worker_type": "decode"}},
                   "num_prefill_workers": args.prefill_workers,
                   "num_decode_workers": args.workers - args.prefill_workers}  # fmt: skip
    else:
        kwargs |= {"extra_engine_args": {"engine": engine}, "num_workers": args.workers}
    report = run_trace_replay([str(trace)], router_mode=mode.removesuffix("_disagg"), trace_format="mooncake",
                              trace_block_size=512, capture_per_request=True, arrival_speedup_ratio=speedup,
                              **kwargs)  # fmt: skip
    s, requests = report.summary, report.per_request
    good = sum(r["terminal_status"] == "completed" and r["ttft_ms"] <= args.ttft_slo_ms
               and (r["itl_ms"] or 0.0) <= args.tbt_slo_ms for r in requests)  # fmt: skip
    return {"ttft_mean": s["mean_ttft_ms"] / 1e3, "ttft_p50": s["median_ttft_ms"] / 1e3,
            "ttft_p90": s["p90_ttft_ms"] / 1e3, "hit_rate": s["prefix_cache_reused_ratio"],
            "itl_mean_ms": s.get("mean_itl_ms", float("nan")), "itl_p99_ms": s.get("p99_itl_ms", float("nan")),
            "completed": s["completed_requests"], "slo_attainment": good / len(requests),
            "goodput": good / (s["duration_ms"] / 1e3)}  # fmt: skip


def simulated(trace: Path, args: argparse.Namespace, profile: Profile, speedup: float) -> dict[str, dict[str, float]]:
    """Our simulator (``bench.sim``) on the same slice and rate, judged as the replay is (mean gap as TBT).

    ``conductor_disagg``: Algorithm 1 with SLO admission on ``--prefill-workers`` + the rest; ``conductor``: the
    same over colocated instances.
    """
    from scheduler.sim.simulator import SimConfig, Simulator
    from scheduler.sim.trace import load_trace

    out = {}
    for name, policy in (("conductor_disagg", "kvcache_centric"), ("conductor", "colocated")):
        decode = args.workers - args.prefill_workers
        config = SimConfig(policy=policy, num_prefill=args.prefill_workers, num_decode=decode,
                           max_ttft=args.ttft_slo_ms / 1e3, max_tbt=args.tbt_slo_ms / 1e3, reject=True)  # fmt: skip
        records = Simulator(config, profile, load_trace(trace, speed=speedup)).run(None).records
        good = 0
        for r in records:
            gap = (r.finish - r.first_token) / max(1, r.num_output_tokens - 1)
            good += r.served and r.first_token - r.arrival <= config.max_ttft and gap <= config.max_tbt
        span = max(r.finish for r in records if r.served) - min(r.arrival for r in records)
        ttfts = sorted(r.first_token - r.arrival for r in records if r.served)
        out[name] = {"ttft_mean": statistics.fmean(ttfts), "ttft_p50": ttfts[len(ttfts) // 2],
                     "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))], "slo_attainment": good / len(records),
                     "goodput": good / span, "rejected": sum(not r.served for r in records)}  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale.dynamo_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_slice_arguments(p)
    p.add_argument("--workers", type=int, default=16, help="mocker workers (default 16)")
    p.add_argument("--prefill-workers", type=int, default=12,
                   help="kv_router_disagg: prefill workers of --workers, the rest decode (default 12)")  # fmt: skip
    p.add_argument("--request-rates", type=float, nargs="+", metavar="R",
                   help="the slice's arrivals scaled to these mean rates, req/s (default: its own rate)")  # fmt: skip
    p.add_argument("--ttft-slo-ms", type=float, default=30000.0, help="TTFT limit (default 30000)")
    p.add_argument("--tbt-slo-ms", type=float, default=300.0, help="limit on a request's mean gap (default 300)")
    p.add_argument("--profile", default="analytic-gpu", help="latency profile: a name or a JSON file")
    p.add_argument("--repeats", type=int, default=3, help="runs per router mode and rate (default 3)")
    args = p.parse_args(argv)
    if not 1 <= args.prefill_workers < args.workers:
        p.error("--prefill-workers must be between 1 and --workers - 1")
    return args


def markdown(record: dict[str, Any]) -> str:
    """One row per (front end, rate), then each front end's SLO capacity."""
    from bench.compare.report import slo_capacity

    head = (f"Dynamo 1.6.1 offline replay (mocker, {record['workers']} workers: aggregated, or "
            f"{record['prefill_workers']} prefill + {record['workers'] - record['prefill_workers']} decode for "
            f"kv_router_disagg; {record['profile']} profile table) and bench.sim on the same slice, "
            f"{record['requests']} requests (outputs capped at {record['max_output_tokens']}), mean of "
            f"{record['repeats']} replays; SLO: TTFT <= {record['ttft_slo_ms']:g} ms and mean gap <= "
            f"{record['tbt_slo_ms']:g} ms; code {record['code']}; `{record['command']}`\n\n"
            "| front end | rate req/s | mean TTFT s | p50 | p90 | within SLO | goodput req/s |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n")  # fmt: skip
    rows, caps = [], []
    for name, by_rate in record["modes"].items():
        for rate, m in by_rate.items():
            rows.append(f"| {name} | {rate} | {m['ttft_mean']:.3f} | {m['ttft_p50']:.3f} | {m['ttft_p90']:.3f} | "
                        f"{m['slo_attainment']:.0%} | {m['goodput']:.2f} |\n")  # fmt: skip
        cap = slo_capacity({float(rate): m for rate, m in by_rate.items()})
        caps.append(f"| {name} | {'below the lowest rate' if cap is None else cap} |\n")
    return (head + "".join(rows) + "\nSLO capacity (the highest rate with at least 90% within SLO, every lower "
            "rate too):\n\n| front end | capacity req/s |\n|---|---:|\n" + "".join(caps))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, t0 = git_state(), time.monotonic()
    out, trace, n = prepare(args, "dynamo-replay")
    profile = named_profile(args.profile)
    table = profile_table(profile, out / "mocker_profile.npz")
    base = own_rate(trace)
    rates = args.request_rates or [round(base, 2)]
    modes: dict[str, dict[str, Any]] = {m: {} for m in (*MODES, "conductor_disagg", "conductor")}
    for rate in rates:
        speedup = rate / base
        for mode in MODES:
            runs = [replay(mode, trace, table, args, profile, speedup) for _ in range(args.repeats)]
            modes[mode][str(rate)] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        for name, m in simulated(trace, args, profile, speedup).items():
            modes[name][str(rate)] = m
        print(f"[dynamo_replay] rate {rate:g}: " + ", ".join(f"{mode} {by[str(rate)]['slo_attainment']:.0%}"
              for mode, by in modes.items()), file=sys.stderr)  # fmt: skip
    command = "python -m bench.scale.dynamo_replay " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = {"kind": "dynamo_replay", "code": code, "command": command, "wall_s": time.monotonic() - t0,
              "requests": n, "own_rate": base, "max_output_tokens": args.max_output_tokens, "workers": args.workers,
              "prefill_workers": args.prefill_workers, "repeats": args.repeats, "ttft_slo_ms": args.ttft_slo_ms,
              "tbt_slo_ms": args.tbt_slo_ms, "profile": profile.name, "block_size": BLOCK_SIZE,
              "tokens_per_worker": TOKENS_PER_WORKER, "modes": modes}  # fmt: skip
    (out / "dynamo_replay.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "dynamo_replay.md").write_text(markdown(record))
    print(f"wrote {out}/dynamo_replay.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
