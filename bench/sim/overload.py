"""Overload study (Mooncake arXiv v3, section 7): plain vs prediction-based early rejection.

    python -m bench.sim.overload                 # conversation trace at 2x speed, 8P+8D, TBT SLO 0.1 s

Both runs use Algorithm 1 with SLO admission on. *plain* judges TBT on the decode batch as booked now;
*prediction* judges it when the request's prefill would end. Writes ``overload.json``, ``overload.png``
(prefill and decode load over time with rejections per minute) and ``overload.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.provenance import fresh_out, git_state
from bench.sim.common import add_common_options, make_profile, run_all, write_json
from bench.sim.plots import plot_overload
from scheduler.sim.simulator import SimConfig

MODES = ("plain", "prediction")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.overload", description=__doc__.split("\n")[0])
    add_common_options(parser)
    parser.add_argument("--speed", type=float, default=2.0, help="time compression (the paper replays at 2x)")
    parser.add_argument("--policy", default="kvcache_centric")
    parser.set_defaults(prefill=8, decode=8, max_tbt=0.1)
    return parser.parse_args(argv)


def oscillation(samples: list[dict[str, float]]) -> dict[str, float]:
    """How much the pools' loads swing: std of each, and the correlation of prefill with decode load."""
    import numpy as np

    prefill = np.array([s["prefill_t_queue_mean"] for s in samples])
    decode = np.array([s["decode_step_mean"] for s in samples])
    corr = float(np.corrcoef(prefill, decode)[0, 1]) if prefill.std() > 0 and decode.std() > 0 else float("nan")
    return {"prefill_t_queue_std_s": float(prefill.std()), "decode_step_std_s": float(decode.std()), "corr": corr}


def table(runs: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| early rejection | rejected | by TTFT / TBT / capacity | served | mean TTFT s | p99 TBT ms | "
        "SLO attainment (TBT<=100 ms) | prefill load std s | decode step std ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, run in runs.items():
        s, o = run["summary"], run["oscillation"]
        r = s["rejections"]
        rows.append(
            f"| {mode} | {sum(r.values())} | {r.get('ttft', 0)} / {r.get('tbt', 0)} / {r.get('capacity', 0)} | "
            f"{s['served']} | {s['ttft']['mean']:.2f} | {s['tbt']['p99'] * 1e3:.1f} | "
            f"{s['slo_attainment']['tbt<=100ms']:.1%} | {o['prefill_t_queue_std_s']:.2f} | "
            f"{o['decode_step_std_s'] * 1e3:.2f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code = git_state()  # before this run writes anything into the tree
    profile = make_profile(args)
    configs = [
        SimConfig(
            policy=args.policy,
            num_prefill=args.prefill,
            num_decode=args.decode,
            max_ttft=args.max_ttft,
            max_tbt=args.max_tbt,
            reject=True,
            early_rejection=mode,
            kv_cache_balancing_threshold=args.threshold,
            seed=args.seed,
            prediction_error=args.prediction_error,
        )
        for mode in MODES
    ]
    t0 = time.perf_counter()
    runs = dict(zip(MODES, run_all(configs, profile, args, args.speed), strict=True))
    for run in runs.values():
        run["oscillation"] = oscillation(run["samples"])
    args.out = args.out or Path(fresh_out("sim"))
    args.out.mkdir(parents=True, exist_ok=True)
    title = (
        f"{profile.name}; {args.prefill}P+{args.decode}D; speed x{args.speed}; "
        f"SLO TTFT {args.max_ttft:g} s, TBT {args.max_tbt * 1e3:g} ms"
    )
    plot_overload(runs, args.out / "overload.png", title)
    record = {
        "command": "python -m bench.sim.overload " + " ".join(argv if argv is not None else sys.argv[1:]),
        "code": code,
        "trace": str(args.trace),
        "speed": args.speed,
        "profile": profile.to_dict(),
        "wall_s_total": time.perf_counter() - t0,
        "runs": {m: {k: v for k, v in r.items() if k not in ("ttft_s", "tbt_s")} for m, r in runs.items()},
    }
    write_json(args.out / "overload.json", record)
    md = table(runs)
    (args.out / "overload.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
