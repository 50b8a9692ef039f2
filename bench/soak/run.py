"""``python -m bench.soak.run``: a bounded soak of a local cluster. Nothing may fail or leak.

    python -m bench.soak.run                                  # own cluster, 150 requests at 1 req/s (~2.5 min)
    python -m bench.soak.run --requests 600 --rate 2          # longer and harder
    python -m bench.soak.run --cluster-json runs/X/cluster.json   # a running cluster (`kvconductor up`)

Steps: start a cluster (1 prefill + 1 decode worker, 64 MiB of KV each, free ports; ``--set`` adds
config overrides) or read ``--cluster-json``; sample every process's RSS and open fds and every
worker's free KV blocks ("start"); send ``--warmup`` requests one at a time, wait until idle, sample
("warmup"); send ``--requests`` streaming chat requests through the REST shim at ``--rate`` req/s,
open loop (Poisson or constant gaps, seeded; ``bench.serve``'s runner and client) while a thread
samples every ``--interval`` s; wait until every worker is idle with its start free blocks (at most
``--drain-timeout`` s); sample ("end"); stop the cluster it started (SIGTERM, then wait; also on
errors, Ctrl-C and SIGTERM).

Reports errors by kind (target 0), TTFT/TPOT/E2E percentiles per ``--window`` s of request start
time, RSS / fds per process and free KV blocks per worker at start, warm-up and end with deltas, and
a PASS/FAIL line (``bench/soak/report.py`` defines it: 0 errors and free blocks back to start on
every worker; RSS and fd growth after warm-up are flagged above thresholds, never failed). Writes
``soak.json``, ``soak.md`` and ``soak.png`` to ``--out``. Exit status: 0 PASS, 1 FAIL, 2 no run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.compare.cluster import disaggregated
from bench.provenance import fresh_out, git_state
from bench.serve import metrics
from bench.serve.client import RequestResult
from bench.serve.runner import Target, check_target, run
from bench.serve.workloads import BenchRequest, random_lengths, shared_prefix
from bench.soak import report
from bench.soak.probe import Prober, cluster_processes, worker_addresses
from cli.local_cluster import REPO, TINY_MODEL, local_cluster

DEFAULT_OUT = "a fresh folder under runs/bench/"
DEFAULT_REQUESTS = 150
SMALL_KV = ("prefill.kv_cache_memory_mb=64", "decode.kv_cache_memory_mb=64")  # as tests/helpers.launch_cluster


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    """Every flag, with its help."""
    p = argparse.ArgumentParser(
        prog="python -m bench.soak.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--requests", type=int, help=f"requests in the soak (default {DEFAULT_REQUESTS}, or rate x --duration-hint)"
    )
    load.add_argument("--rate", type=float, default=1.0, help="arrival rate in requests/s, open loop (default 1.0)")
    load.add_argument(
        "--duration-hint",
        type=float,
        metavar="SECONDS",
        help="size the run by time instead of count: --requests = round(rate x SECONDS) (not with --requests)",
    )
    load.add_argument(
        "--arrivals",
        choices=["poisson", "constant"],
        default="poisson",
        help="poisson: exponential gaps (seeded); constant: one every 1/rate s (default poisson)",
    )
    load.add_argument("--warmup", type=int, default=4, help="requests sent one at a time before the soak (default 4)")
    load.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrivals (default 0)")
    load.add_argument("--model", default="tiny-llama", help="the model field of every request (default tiny-llama)")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=["shared-prefix", "random"],
        default="shared-prefix",
        help="shared-prefix: N prefixes x distinct suffixes, round robin; random: independent prompts (default "
        "shared-prefix)",
    )
    w.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes (default 4)")
    w.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens (default 256)")
    w.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: suffix tokens (default 32)")
    w.add_argument("--output-len", type=int, default=32, help="shared-prefix: output tokens (default 32)")
    w.add_argument(
        "--input-range", type=_range, default=(64, 512), metavar="LO:HI", help="random: prompt tokens (default 64:512)"
    )
    w.add_argument(
        "--output-range", type=_range, default=(8, 64), metavar="LO:HI", help="random: output tokens (default 8:64)"
    )
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster-json", help="use this running cluster's cluster.json instead of starting one")
    c.add_argument(
        "--config",
        default=str(REPO / "deploy/config.toml"),
        help="config file of the own cluster (default deploy/config.toml)",
    )
    c.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for the own cluster (repeatable; after the defaults: 1 prefill + 1 decode worker, "
        "64 MiB KV each, free ports)",
    )
    r = p.add_argument_group("measurement and report")
    r.add_argument("--interval", type=float, default=5.0, help="seconds between resource samples (default 5)")
    r.add_argument("--window", type=float, default=30.0, help="latency window in seconds (default 30)")
    r.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds to wait after the load (and after the warm-up) for every worker to be idle with its start "
        "free blocks (default 60)",
    )
    r.add_argument(
        "--rss-flag-mib",
        type=float,
        default=32.0,
        help="flag RSS growth after warm-up above this many MiB (default 32)",
    )
    r.add_argument(
        "--rss-flag-pct",
        type=float,
        default=10.0,
        help="... or above this %% of the warm-up RSS, if larger (default 10)",
    )
    r.add_argument(
        "--fd-flag", type=int, default=8, help="flag growth of open fds after warm-up above this (default 8)"
    )
    r.add_argument(
        "--out", help=f"directory for soak.json/.md/.png (default {DEFAULT_OUT}; bench/results/soak to update those)"
    )
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def request_count(args: argparse.Namespace) -> int:
    """--requests, or rate x --duration-hint, or the default."""
    if args.requests is not None and args.duration_hint is not None:
        raise ValueError("give --requests or --duration-hint, not both")
    if args.rate <= 0:
        raise ValueError("--rate must be > 0")
    n = args.requests if args.requests is not None else DEFAULT_REQUESTS
    if args.duration_hint is not None:
        n = round(args.rate * args.duration_hint)
    if n < 1:
        raise ValueError("the soak needs at least one request")
    return int(n)


def build_requests(args: argparse.Namespace, n: int, seed: int) -> list[BenchRequest]:
    """``n`` requests of the chosen workload; with constant arrivals, each at i / rate s."""
    if args.workload == "shared-prefix":
        per = math.ceil(n / max(1, args.num_prefixes))
        requests = shared_prefix(args.num_prefixes, per, args.prefix_len, args.suffix_len, args.output_len, seed)[:n]
    else:
        requests = random_lengths(n, args.input_range, args.output_range, seed)
    if args.arrivals == "constant":
        requests = [BenchRequest(r.prompt_ids, r.max_tokens, i / args.rate) for i, r in enumerate(requests)]
    return requests


class Log:
    """Progress lines on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.t0 = quiet, time.monotonic()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[soak {time.monotonic() - self.t0:6.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass
class Cluster:
    """What the soak runs against."""

    manifest: dict[str, Any]
    launcher_pid: int | None
    description: str
    run_dir: str | None = None


@contextmanager
def cluster(args: argparse.Namespace, log: Log) -> Iterator[Cluster]:
    """The given cluster, or a new one that is stopped on the way out (SIGTERM, then wait)."""
    if args.cluster_json:
        if args.set:
            raise ValueError("--set configures the own cluster; it cannot change one given by --cluster-json")
        try:
            manifest = json.loads(Path(args.cluster_json).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read --cluster-json {args.cluster_json}: {e}") from None
        yield Cluster(manifest, None, f"given ({args.cluster_json})")
        return
    run_dir = REPO / "runs" / time.strftime("soak-%Y%m%d-%H%M%S") / "cluster"
    overrides = (*disaggregated(), *SMALL_KV, *args.set)
    log(f"starting a cluster (kvconductor up; logs in {run_dir}): {' '.join(overrides)}")
    try:
        with local_cluster(args.config, (*TINY_MODEL, *overrides), run_dir) as running:
            log(f"cluster up in {running.startup_s:.1f} s at {running.manifest['rest']}")
            description = "own: 1 prefill + 1 decode, " + ", ".join(overrides[3:])
            yield Cluster(running.manifest, running.process.pid, description, str(run_dir))
            log("stopping the cluster (SIGTERM to kvconductor up, then wait)")
    finally:
        log("cluster stopped" if run_dir.joinpath("cluster.json").exists() else "cluster start-up abandoned")


@dataclass
class Sampler:
    """Samples in a thread every ``interval`` s while the load runs; times relative to ``origin``."""

    prober: Prober
    interval: float
    origin: float
    log: Log
    window: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "load"
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def take(self, label: str) -> dict[str, Any]:
        s = self.prober.sample(label, time.perf_counter() - self.origin)
        self.samples.append(s)
        return s

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        shown = -1
        while not self._stop.wait(self.interval):
            s = self.take(self.phase)
            if int(s["t_s"] // self.window) != shown:
                shown = int(s["t_s"] // self.window)
                self.log(f"t={s['t_s']:.0f} s: {describe(s)}")


def describe(sample: dict[str, Any]) -> str:
    """One line: total RSS, fds, free blocks per worker."""
    procs = sample["processes"].values()
    rss = sum(p["rss_kib"] or 0 for p in procs) / 1024
    fds = sum(p["fds"] or 0 for p in procs)
    free = ", ".join(
        f"{key} {w['free_blocks']}/{w['total_blocks']} free" if w else f"{key} unreachable"
        for key, w in sample["workers"].items()
    )
    return f"RSS {rss:.0f} MiB in {len(sample['processes'])} processes, {fds} fds; {free}"


def wait_idle(prober: Prober, baseline: dict[str, Any], timeout: float) -> float | None:
    """Seconds until every worker is idle with the baseline's free blocks; None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if prober.idle(baseline):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def soak(args: argparse.Namespace, target: Cluster, n: int, log: Log) -> dict[str, Any]:
    """Warm up, load, drain, sample throughout; the JSON record (without the outputs written)."""
    wall0 = time.monotonic()
    rest = Target(target.manifest["rest"].rstrip("/"), args.model)
    asyncio.run(check_target(rest))
    prober = Prober(cluster_processes(target.manifest, target.launcher_pid), worker_addresses(target.manifest))
    if not prober.workers:
        raise ValueError("no engine workers are registered in etcd")
    try:
        sampler = Sampler(prober, args.interval, 0.0, log, args.window)  # absolute times until the load starts
        start = sampler.take("start")
        log(f"start: {describe(start)}")
        warm = build_requests(args, args.warmup, args.seed + 1_000_003) if args.warmup else []
        warm_results: list[RequestResult] = []
        if warm:
            log(f"warm-up: {len(warm)} requests, one at a time")
            warm_results, _ = asyncio.run(run(rest, warm, concurrency=1, quiet=True))
            if wait_idle(prober, start, args.drain_timeout) is None:
                log(f"warning: not idle with the start free blocks {args.drain_timeout:g} s after the warm-up")
        log(f"warm-up: {describe(sampler.take('warmup'))}")
        requests = build_requests(args, n, args.seed)
        log(f"soak: {n} requests at {args.rate:g} req/s ({args.arrivals}), about {n / args.rate:.0f} s")
        sampler.origin = time.perf_counter()
        for s in sampler.samples:  # start and warm-up: negative offsets from the start of the load
            s["t_s"] -= sampler.origin
        sampler.start()
        try:
            rate = args.rate if args.arrivals == "poisson" else None
            results, duration = asyncio.run(run(rest, requests, None, rate, args.seed, args.quiet))
            sampler.phase = "drain"
            log(f"load done in {duration:.1f} s; waiting for every worker to drain")
            drain_s = wait_idle(prober, start, args.drain_timeout)
        finally:
            sampler.stop()
        log(f"drained in {drain_s:.1f} s" if drain_s is not None else f"not drained after {args.drain_timeout:g} s")
        log(f"end: {describe(sampler.take('end'))}")
        samples = sampler.samples
    finally:
        prober.close()
    return {
        "results": results,
        "duration": duration,
        "drain_s": drain_s,
        "samples": samples,
        "warm_results": warm_results,
        "load_wall_s": time.monotonic() - wall0,
        "workers": prober.workers,
        "processes": prober.processes,
    }


def record_of(args: argparse.Namespace, target: Cluster, n: int, run_: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The JSON record: config, summary, windows, resources, verdict, samples, per-request results."""
    results = run_["results"]
    thresholds = report.Thresholds(args.rss_flag_mib, args.rss_flag_pct, args.fd_flag)
    table = report.resources(run_["samples"])
    config = {k: v for k, v in vars(args).items() if k not in ("quiet",)} | {"requests": n}
    return {
        "kind": "soak",
        "code": git_state(),
        "command": "python -m bench.soak.run " + shlex.join(sys.argv[1:]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": wall_s,
        "config": config,
        "cluster": {
            "description": target.description,
            "rest": target.manifest["rest"],
            "run_dir": target.run_dir,
            "processes": run_["processes"],
            "workers": run_["workers"],
        },
        "warmup": {
            "requests": len(run_["warm_results"]),
            "errors": sum(r.error is not None for r in run_["warm_results"]),
        },
        "summary": metrics.summarize(results, run_["duration"]),
        "windows": report.windows(results, args.window),
        "resources": table,
        "drain_s": run_["drain_s"],
        "thresholds": vars(thresholds),
        "verdict": report.verdict(n, results, table, thresholds),
        "samples": run_["samples"],
        "requests": [vars(r) | {"tpot": r.tpot} for r in results],
    }


def write(record: dict[str, Any], out: Path) -> None:
    """soak.json, soak.md, soak.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(metrics.jsonable(record), indent=1, default=str) + "\n")
    (out / "soak.md").write_text(report.markdown(record))
    report.plot(record, record["samples"], out / "soak.png")


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 PASS, 1 FAIL, 2 when it could not run."""
    args = parser().parse_args(argv)
    log = Log(args.quiet)
    try:
        n = request_count(args)
        build_requests(args, 1, args.seed)  # bad workload flags fail before a cluster starts
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)  # so the own cluster is stopped on SIGTERM too
    t0 = time.monotonic()
    try:
        with cluster(args, log) as target:
            run_ = soak(args, target, n, log)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no report written (the cluster this run started is stopped)", file=sys.stderr)
        return 130
    record = record_of(args, target, n, run_, time.monotonic() - t0)
    args.out = args.out or fresh_out("soak")
    write(record, Path(args.out))
    print(metrics.format_table(record["summary"]))
    print(f"wrote {args.out}/soak.json, soak.md, soak.png")
    print(record["verdict"]["line"])
    return 0 if record["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
