"""Dynamo's KV router on the same trace slice and profile, offline: ``dynamo.replay`` over its mocker engines.

    make dynamo                                   # once: Dynamo 1.6.1 into .venv-dynamo (see ENVIRONMENT.md)
    .venv-dynamo/bin/python -m bench.scale.dynamo_replay --limit 200
    .venv-dynamo/bin/python -m bench.scale.dynamo_replay --limit 400 --workers 16 --out bench/results/scale

Runs in Dynamo's own virtual environment (``ai-dynamo`` cannot share ours: it pins other versions) and
imports only this repository's standard-library and numpy parts. The mocker's timing is a profile table
(``.npz``) computed from the same latency profile the emulated engine and ``bench.sim`` use, so the three
see the same hardware. Matched: block size, KV capacity per worker, batch limits
(``max_num_batched_tokens``, ``max_num_seqs``), chunked prefill and prefix caching on. Different:

- the mocker looks prefill time up by the step's uncached tokens only, so the attention cost of a long
  cached context (the profile's c2 term) is not charged, which flatters every policy there a little;
- its workers are aggregated (each prefills and decodes, vLLM-style), like our colocated deployment;
- its virtual clock has no serving overheads (no RPCs, no KV transfers between workers).

Each router mode runs ``--repeats`` times (Dynamo breaks ties at random) and reports mean TTFT (s), its
p50/p90, the prefix reuse ratio and ITL. Writes ``dynamo_replay.{json,md}`` and the slice under ``--out``.
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
from scheduler.sim.profiles import Profile, named_profile

MODES = ("kv_router", "round_robin")
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


def replay(mode: str, trace: Path, table: Path, workers: int, profile: Profile) -> dict[str, float]:
    """One offline replay: the summary numbers kept."""
    from dynamo.llm import KvRouterConfig
    from dynamo.replay import run_trace_replay

    timing = {"type": "external", "provider": "dynamo_profile", "config": {"path": str(table)}}
    engine = {"block_size": BLOCK_SIZE, "num_gpu_blocks": TOKENS_PER_WORKER // BLOCK_SIZE,
              "max_num_seqs": profile.max_running, "max_num_batched_tokens": profile.chunk_tokens,
              "enable_prefix_caching": True, "enable_chunked_prefill": True, "timing_model": timing}  # fmt: skip
    kwargs: dict[str, Any] = {"router_config": KvRouterConfig()} if mode == "kv_router" else {}
    report = run_trace_replay([str(trace)], extra_engine_args={"engine": engine}, num_workers=workers,
                              router_mode=mode, trace_format="mooncake", trace_block_size=512, **kwargs)  # fmt: skip
    s = report.summary
    return {"ttft_mean": s["mean_ttft_ms"] / 1e3, "ttft_p50": s["median_ttft_ms"] / 1e3,
            "ttft_p90": s["p90_ttft_ms"] / 1e3, "hit_rate": s["prefix_cache_reused_ratio"],
            "itl_mean_ms": s.get("mean_itl_ms", float("nan")), "itl_p99_ms": s.get("p99_itl_ms", float("nan")),
            "completed": s["completed_requests"]}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale.dynamo_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_slice_arguments(p)
    p.add_argument("--workers", type=int, default=16, help="aggregated mocker workers (default 16)")
    p.add_argument("--profile", default="analytic-gpu", help="latency profile: a name or a JSON file")
    p.add_argument("--repeats", type=int, default=3, help="runs per router mode (default 3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, t0 = git_state(), time.monotonic()
    out, trace, n = prepare(args, "dynamo-replay")
    profile = named_profile(args.profile)
    table = profile_table(profile, out / "mocker_profile.npz")
    modes: dict[str, Any] = {}
    for mode in MODES:
        runs = [replay(mode, trace, table, args.workers, profile) for _ in range(args.repeats)]
        modes[mode] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        m = modes[mode]
        print(f"[dynamo_replay] {mode}: mean TTFT {m['ttft_mean']:.3f} s, hit {m['hit_rate']:.1%}", file=sys.stderr)
    command = "python -m bench.scale.dynamo_replay " + shlex.join(argv if argv is not None else sys.argv[1:])
    record = {"kind": "dynamo_replay", "code": code, "command": command, "wall_s": time.monotonic() - t0,
              "requests": n, "max_output_tokens": args.max_output_tokens, "workers": args.workers,
              "profile": profile.name, "block_size": BLOCK_SIZE, "tokens_per_worker": TOKENS_PER_WORKER,
              "modes": modes}  # fmt: skip
    (out / "dynamo_replay.json").write_text(json.dumps(record, indent=2) + "\n")
    rows = "\n".join(
        f"| {mode} | {m['ttft_mean']:.3f} | {m['ttft_p50']:.3f} | {m['ttft_p90']:.3f} | {m['hit_rate']:.1%} |"
        for mode, m in modes.items()
    )
    (out / "dynamo_replay.md").write_text(
        f"Dynamo 1.6.1 offline replay (mocker, {args.workers} aggregated workers, {profile.name} profile table), "
        f"{n} requests (outputs capped at {args.max_output_tokens}), mean of {args.repeats} runs; code {code}; "
        f"`{command}`\n\n| router | mean TTFT s | p50 | p90 | prefix reuse |\n|---|---:|---:|---:|---:|\n{rows}\n"
    )
    print(f"wrote {out}/dynamo_replay.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
