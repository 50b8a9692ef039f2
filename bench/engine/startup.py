"""Start-up: seconds until a local cluster serves, without and with a kept start-up profile, beside stock vLLM.

Every worker profiles its engine when it starts (the cost models the Conductor schedules with) and keeps the
profile (``[engine] profile_cache_dir``); a later start whose model, engine, shapes and host are unchanged
loads it instead (``services/worker/profiling/cache.py``). This times, ``--repeats`` times each:

* **our clusters** (``kvconductor up`` until its ``cluster.json``: etcd, kvmeta, Conductor, gateway and every
  worker healthy and registered), on the built-in engine (``deploy/config.toml``) and on vLLM
  (``deploy/vllm.toml``), as one prefill + one decode worker and as one colocated worker: **cold** (an
  empty profile folder: the first start on a machine) and **warm** (the same folder again);
* **the stock vLLM server** (``bench.compare.vllm_server``: vLLM's own OpenAI server with the engine
  arguments our colocated worker builds) until ``GET /health`` answers: what vLLM itself takes to load.

    .venv/bin/python -m bench.engine.startup --out bench/results/engine/startup   # table on stdout, progress on stderr
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.compare.cluster import colocated, disaggregated
from bench.compare.peers import HOST, serving
from bench.provenance import fresh_out, git_state
from cli.local_cluster import local_cluster
from services.common.net import free_port

ENGINES = {"builtin": "deploy/config.toml", "vllm": "deploy/vllm.toml"}
DEPLOYMENTS = {"pd": disaggregated(2, 1), "colocated": colocated(1)}
STOCK_READY_TIMEOUT_S = 600.0


def _progress(message: str) -> None:
    print(f"[startup] {message}", file=sys.stderr, flush=True)


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=sorted(ENGINES))
    parser.add_argument("--repeats", type=int, default=2, help="starts of each kind (default 2)")
    parser.add_argument("--out", help="results folder (default: a fresh runs/bench/startup-<time>)")
    return parser.parse_args(argv)


def _ours(engine: str, deployment: str, profiles: Path, run_dir: Path) -> float:
    overrides = [*DEPLOYMENTS[deployment], f'engine.profile_cache_dir="{profiles}"']
    with local_cluster(ENGINES[engine], overrides, run_dir) as cluster:
        return cluster.startup_s


def _stock(run_dir: Path) -> float:
    port = free_port()
    command = [sys.executable, "-m", "bench.compare.vllm_server", "--config", ENGINES["vllm"], "--host", HOST,
               "--role", "colocated", "--port", str(port)]  # fmt: skip
    t0 = time.monotonic()
    with serving(command, port, "stock vLLM server", run_dir / "vllm-server.log", STOCK_READY_TIMEOUT_S):
        return time.monotonic() - t0


def _summary(seconds: list[float]) -> dict[str, Any]:
    return {"seconds": [round(s, 1) for s in seconds], "median_s": round(statistics.median(seconds), 1)}


def main(argv: list[str] | None = None) -> None:
    """Time every start, print the table, write startup.json into the results folder."""
    args = _args(argv)
    out = Path(args.out or fresh_out("startup"))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.engine.startup " + shlex.join(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {"command": command.strip(), "code": git_state(), "starts": {}}
    with tempfile.TemporaryDirectory(prefix="kvc-startup-") as scratch:
        for engine in args.engines:
            for deployment in DEPLOYMENTS:
                times: dict[str, list[float]] = {"cold": [], "warm": []}
                for i in range(args.repeats):
                    profiles = Path(scratch) / f"{engine}-{deployment}-{i}"  # empty: the cold start profiles
                    for kind in ("cold", "warm"):
                        run_dir = Path(scratch) / f"run-{engine}-{deployment}-{i}-{kind}"
                        took = _ours(engine, deployment, profiles, run_dir)
                        times[kind].append(took)
                        _progress(f"{engine} {deployment} {kind} start {i + 1}/{args.repeats}: {took:.1f} s")
                for kind, seconds in times.items():
                    results["starts"][f"{engine} {deployment} {kind}"] = _summary(seconds)
        if "vllm" in args.engines:
            stock = []
            for i in range(args.repeats):
                stock.append(_stock(Path(scratch) / f"stock-{i}"))
                _progress(f"stock vLLM server start {i + 1}/{args.repeats}: {stock[-1]:.1f} s")
            results["starts"]["stock vLLM server"] = _summary(stock)
    (out / "startup.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| start | median s | each s |\n|---|---:|---|")
    for name, row in results["starts"].items():
        print(f"| {name} | {row['median_s']} | {', '.join(map(str, row['seconds']))} |")
    _progress(f"wrote {out / 'startup.json'}")


if __name__ == "__main__":
    main()
