"""``kvconductor bench compare --routers``: the Conductor vs. third-party routers on the same workers.

    kvconductor bench compare --routers --requests 30 --num-prefixes 3 --concurrency 1 4
    kvconductor bench compare --routers --contenders conductor sglang:cache_aware vllm:power_of_two
    kvconductor bench compare --routers --cluster-json runs/<ts>/cluster.json   # a cluster already up

One colocated cluster (``kvconductor up`` with two colocated workers, no prefill/decode pool) serves
these contenders, one after the other:

- ``conductor``: our gateway, so the Conductor schedules over the colocated workers (its policy is the
  cluster's ``[scheduler] policy``, ``kvcache_centric`` unless ``--set scheduler.policy=...``);
- ``sglang:POLICY`` / ``vllm:POLICY``: ``python -m sglang_router.launch_router`` or
  ``python -m vllm_router.launch_router`` (the PyPI packages ``sglang-router`` and ``vllm-router``)
  started on a free port with ``--worker-urls`` = every worker's ``openai_url`` (the OpenAI API each
  colocated worker serves itself, read from its etcd record), then stopped after its runs.

Two more deployments use the same two worker slots (one engine each), started after the colocated cluster
is stopped:

- ``conductor:disaggregated``: a prefill/decode cluster (one prefill, one decode worker) behind our
  gateway: the Conductor's Algorithm 1 with KV moving prefill -> decode;
- ``vllm-pd:POLICY`` (``--engine vllm`` only): ``vllm-router``'s own prefill/decode mode
  (``--vllm-pd-disaggregation --kv-connector mooncake``) over two stock vLLM OpenAI servers that run our
  workers' engine arguments (``bench/compare/vllm_server.py``): vllm-router passes ``kv_transfer_params``
  over HTTP, which our gRPC workers do not take, so it drives vLLM's own servers instead.

Every contender gets the same workload shape at the same concurrency levels. Prompts are fresh for
every (contender, level) (seed ``--seed + 100 * contender + level``), so no contender finds the prefixes
of an earlier one in the workers' caches: each starts as cold as the first. The request order is
shuffled (seeded): the shared-prefix workload is ordered round-robin over its prefixes, so with as many
prefixes as workers a round-robin router would send each prefix to one worker and look cache-aware.

Beside the client-side table (TTFT, TPOT, hit rate from ``usage.prompt_tokens_details.cached_tokens``,
throughput, goodput) each run records what the workers saw, from their own ``/metrics``: the share of
prompt tokens each worker's engine looked up and its prefix-cache hits. After the levels a probe
sends ``PROBE_REQUESTS`` sequential requests that share one fresh prefix: a cache-aware router sends
them all to one worker, a round-robin one spreads them.

Writes ``routers.json``, ``routers.md`` and ``routers.png`` under ``--out``; logs of the cluster and
of every router under ``runs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.compare import report
from bench.compare.cluster import colocated, disaggregated
from bench.serve import metrics
from bench.serve.cli import build_workload
from bench.serve.runner import Target, check_target, run
from bench.serve.workloads import shared_prefix
from cli.local_cluster import local_cluster, stop
from services.common.net import free_port

ROUTER_MODULES = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router",
                  "vllm-pd": "vllm_router.launch_router"}  # fmt: skip
ROUTER_PACKAGES = {"sglang": "sglang-router", "vllm": "vllm-router", "vllm-pd": "vllm-router"}
ROUTER_POLICIES = {"sglang": ("cache_aware", "round_robin", "power_of_two", "random"),
                   "vllm": ("cache_aware", "kv_aware", "power_of_two", "round_robin", "random"),
                   "vllm-pd": ("cache_aware", "power_of_two", "round_robin", "random")}  # fmt: skip
DEFAULT_CONTENDERS = {
    "builtin": ("conductor", "sglang:cache_aware", "sglang:round_robin", "vllm:cache_aware", "vllm:power_of_two",
                "vllm:kv_aware"),
    "vllm": ("conductor", "conductor:disaggregated", "sglang:cache_aware", "vllm:cache_aware", "vllm:power_of_two",
             "vllm-pd:cache_aware"),
    "emulated": ("conductor", "conductor:disaggregated", "sglang:cache_aware", "vllm:cache_aware", "vllm:kv_aware"),
}  # fmt: skip
DEPLOYMENTS = {"colocated": colocated, "disaggregated": disaggregated}
SERVER_READY_TIMEOUT_S = 300.0
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_STOP_TIMEOUT_S = 15.0
PROBE_REQUESTS = 4
WARMUP_REQUESTS = 2
HOST = "127.0.0.1"
# Why kv_aware is degraded here (from vllm-router's own start-up warnings, see its log).
KV_AWARE_NOTE = ("no KV events: our workers publish block events to kvmeta, not vLLM's ZMQ KV events, and answer "
                 "404 to /get_server_info and /kv_event_sources, so vllm-router's kv index stays empty")  # fmt: skip


@dataclass(frozen=True)
class Contender:
    """One front end for the workers: our gateway (``router`` None) or a PyPI router with a policy."""

    spec: str  # "conductor", "sglang:cache_aware", ...
    router: str | None
    policy: str
    deployment: str  # "colocated", "disaggregated" (our clusters) or "vllm-pd" (stock vLLM servers)

    @property
    def label(self) -> str:
        """Table label, e.g. ``sglang-router cache_aware``."""
        if self.router is None:
            return f"conductor{' PD' if self.deployment == 'disaggregated' else ''} ({self.policy})"
        return f"{ROUTER_PACKAGES[self.router]}{' PD' if self.router == 'vllm-pd' else ''} {self.policy}"


def parse_contender(spec: str, conductor_policy: str = "kvcache_centric") -> Contender:
    """``conductor``, ``conductor:disaggregated`` or ``ROUTER:POLICY``; ValueError for anything else."""
    if spec in ("conductor", "conductor:colocated", "conductor:disaggregated"):
        return Contender(spec, None, conductor_policy, spec.partition(":")[2] or "colocated")
    router, _, policy = spec.partition(":")
    if router not in ROUTER_MODULES or policy not in ROUTER_POLICIES[router]:
        choices = ", ".join(f"{r}:{p}" for r, ps in ROUTER_POLICIES.items() for p in ps)
        raise ValueError(f"unknown contender {spec!r}: use conductor, conductor:disaggregated or one of {choices}")
    return Contender(spec, router, policy, "vllm-pd" if router == "vllm-pd" else "colocated")


def router_available(router: str) -> str | None:
    """None when the router's launcher imports here, else why not."""
    module = ROUTER_MODULES[router]
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return None if found else f"{ROUTER_PACKAGES[router]} is not installed (no module {module})"


def router_command(contender: Contender, worker_args: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """The launcher's command line. Each router gets its own Prometheus port: both default to 29000.

    ``worker_args``: ``--worker-urls URL...`` for a colocated pool, ``--prefill URL PORT --decode URL`` in PD.
    """
    assert contender.router is not None
    level = "warn" if contender.router == "sglang" else "warning"
    return [sys.executable, "-m", ROUTER_MODULES[contender.router], "--host", HOST, "--port", str(port),
            *worker_args, "--policy", contender.policy,
            "--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", level]  # fmt: skip


def _stop(process: subprocess.Popen[bytes]) -> None:
    stop(process, ROUTER_STOP_TIMEOUT_S)


@contextmanager
def serving(command: Sequence[str], port: int, name: str, log_path: Path, timeout_s: float) -> Iterator[None]:
    """Start an HTTP server process, wait until ``GET /health`` on ``port`` answers 200, stop it after."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        log.write((" ".join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{name} exited with {process.returncode}: " + " | ".join(tail))
            try:
                if httpx.get(f"http://{HOST}:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{name} not healthy after {timeout_s:.0f} s ({log_path})")
            time.sleep(0.25)
        yield
    finally:
        _stop(process)


@contextmanager
def running_router(contender: Contender, worker_args: Sequence[str], log_path: Path) -> Iterator[str]:
    """Start the router (``router_command``) until healthy, yield its ``/v1`` base URL, stop it."""
    port, metrics_port = free_port(), free_port()
    command = router_command(contender, worker_args, port, metrics_port)
    with serving(command, port, contender.label, log_path, ROUTER_READY_TIMEOUT_S):
        yield f"http://{HOST}:{port}/v1"


@contextmanager
def stock_vllm_pd(args: argparse.Namespace, root: Path) -> Iterator[list[str]]:
    """One prefill and one decode stock vLLM server (``bench/compare/vllm_server.py``); yields the router's
    worker arguments ``--vllm-pd-disaggregation --kv-connector mooncake --prefill URL PORT --decode URL``."""
    ports = {role: free_port() for role in ("prefill", "decode")}
    base = [sys.executable, "-m", "bench.compare.vllm_server", "--config", args.config, "--host", HOST,
            *(a for override in args.set for a in ("--set", override))]  # fmt: skip
    logs = {role: root / f"vllm-server-{role}.log" for role in ports}
    print(f"[routers] starting stock vLLM prefill and decode servers (logs {root}) ...", file=sys.stderr, flush=True)
    with (
        serving([*base, "--role", "prefill", "--port", str(ports["prefill"])], ports["prefill"], "vLLM prefill server",
                logs["prefill"], SERVER_READY_TIMEOUT_S),
        serving([*base, "--role", "decode", "--port", str(ports["decode"])], ports["decode"], "vLLM decode server",
                logs["decode"], SERVER_READY_TIMEOUT_S),
    ):  # fmt: skip
        found = re.search(r"bootstrap_port=(\d+)", logs["prefill"].read_text(errors="replace"))
        if not found:
            raise RuntimeError(f"the vLLM prefill server printed no bootstrap port ({logs['prefill']})")
        yield ["--vllm-pd-disaggregation", "--kv-connector", "mooncake",
               "--prefill", f"http://{HOST}:{ports['prefill']}", found.group(1),
               "--decode", f"http://{HOST}:{ports['decode']}"]  # fmt: skip


# --- the workers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's ids and URLs, from its etcd record (``openai_url`` only on colocated workers)."""

    instance_id: str
    openai_url: str
    metrics_address: str


def cluster_workers(manifest: dict[str, Any], deployment: str = "colocated") -> list[WorkerInfo]:
    """The workers registered in the cluster that ``manifest`` (cluster.json) describes.

    Colocated: every colocated worker with an ``openai_url`` (the routers' targets); disaggregated: every
    prefill and decode worker.
    """
    from services.common.instance_record import WorkerRecord
    from services.common.registry import Registry

    registry = Registry(manifest["etcd"], manifest["cluster"])
    roles = ("colocated",) if deployment == "colocated" else ("prefill", "decode")
    workers = [
        WorkerInfo(instance_id, record.openai_url, record.metrics_address)
        for role in roles
        for (_, instance_id), record in sorted(registry.list(role).items())
        if isinstance(record, WorkerRecord) and (record.openai_url or deployment != "colocated")
    ]
    if not workers:
        raise RuntimeError(f"no {'/'.join(roles)} worker in etcd (node_count > 0? an openai_url when colocated?)")
    return workers


_SAMPLE = re.compile(r"^(kvconductor_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$")
COUNTERS = {
    "kvconductor_prefix_cache_query_tokens": "query_tokens",
    "kvconductor_prefix_cache_hit_tokens": "hit_tokens",
}


def scrape(worker: WorkerInfo) -> dict[str, float]:
    """The worker engine's prefix-cache counters and its OpenAI endpoint's completed chat/completions calls."""
    text = httpx.get(f"http://{worker.metrics_address}/metrics", timeout=5.0).text
    out = {"query_tokens": 0.0, "hit_tokens": 0.0, "http_requests": 0.0}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in COUNTERS:
            out[COUNTERS[name]] += value
        elif name == "kvconductor_http_requests" and "completions" in labels and 'status="200"' in labels:
            out["http_requests"] += value
    return out


def scrape_all(workers: Sequence[WorkerInfo]) -> dict[str, dict[str, float]]:
    """``scrape`` of every worker, by instance id."""
    return {w.instance_id: scrape(w) for w in workers}


def worker_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per worker: counter increases, share of the prompt tokens looked up, engine hit rate."""
    deltas = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}
    total = sum(d["query_tokens"] for d in deltas.values())
    for d in deltas.values():
        d["token_share"] = d["query_tokens"] / total if total else 0.0
        d["hit_rate"] = d["hit_tokens"] / d["query_tokens"] if d["query_tokens"] else 0.0
    return deltas


# --- one contender ----------------------------------------------------------------------------------


def workload(args: argparse.Namespace, seed: int) -> list[Any]:
    """``bench serve``'s workload for these flags and seed, in a seeded shuffled order."""
    requests = build_workload(argparse.Namespace(**{**vars(args), "seed": seed}))
    random.Random(seed).shuffle(requests)
    return requests


@dataclass(frozen=True)
class Level:
    """One load level: closed loop at ``concurrency`` or open loop at ``rate`` requests/s (Poisson)."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        """``c=4`` or ``rate=2.5``."""
        return f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}"


def levels(args: argparse.Namespace) -> list[Level]:
    """``--request-rates`` (open loop) when given, else ``--concurrency`` (closed loop)."""
    if getattr(args, "request_rates", None):
        return [Level(rate=r) for r in args.request_rates]
    return [Level(concurrency=c) for c in args.concurrency]


def run_level(target: Target, args: argparse.Namespace, level: Level, seed: int) -> dict[str, Any]:
    """One run at ``level``; the record ``bench serve`` writes, plus the seed."""
    requests = workload(args, seed)
    results, duration = asyncio.run(run(target, requests, level.concurrency, level.rate, seed, args.quiet))
    summary = metrics.summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms)
    return {"seed": seed, "concurrency": level.concurrency, "rate": level.rate, "summary": summary,
            "requests": [vars(r) | {"tpot": r.tpot} for r in results]}  # fmt: skip


def smoke(target: Target) -> None:
    """One short request through the front end; RuntimeError unless it streams tokens."""
    one = shared_prefix(1, 1, 0, 8, 2, seed=12345)
    results, _ = asyncio.run(run(target, one, 1, None, 0, True))
    if results[0].error:
        raise RuntimeError(f"smoke request through {target.base_url} failed: {results[0].error}")


def probe(target: Target, args: argparse.Namespace, workers: Sequence[WorkerInfo], seed: int) -> dict[str, Any]:
    """``PROBE_REQUESTS`` sequential requests sharing one fresh prefix: where did they go?"""
    requests = shared_prefix(1, PROBE_REQUESTS, args.prefix_len, args.suffix_len, 4, seed)
    before = scrape_all(workers)
    results, _ = asyncio.run(run(target, requests, 1, None, seed, True))
    deltas = worker_deltas(before, scrape_all(workers))
    return {"seed": seed, "failed": sum(r.error is not None for r in results),
            "token_share": {w: d["token_share"] for w, d in deltas.items()}}  # fmt: skip


def run_contender(
    contender: Contender,
    index: int,
    args: argparse.Namespace,
    base_url: str,
    workers: Sequence[WorkerInfo],
) -> dict[str, Any]:
    """Every level and the probe against one front end."""
    target = Target(base_url, args.model, None, args.endpoint)
    if contender.router is None:
        asyncio.run(check_target(target))  # the routers' /v1/models need not list our model (sglang: "unknown")
    smoke(target)
    runs: dict[str, Any] = {}
    for j, level in enumerate(levels(args)):
        before = scrape_all(workers)
        record = run_level(target, args, level, args.seed + 100 * index + j)
        record["workers"] = worker_deltas(before, scrape_all(workers))
        runs[level.label] = record
        s = record["summary"]
        shares = "/".join(f"{d['token_share']:.0%}" for d in record["workers"].values())
        print(f"[routers] {contender.label} {level.label}: TTFT p50 {s['ttft_ms']['median']:.1f} ms, TPOT p50 "
              f"{s['tpot_ms']['median']:.2f} ms, hit {s['prefix_cache_hit_rate']:.1%}, "
              f"{s['completed']}/{s['requests']} done, worker token shares {shares}",
              file=sys.stderr, flush=True)  # fmt: skip
    result: dict[str, Any] = {"label": contender.label, "spec": contender.spec, "base_url": base_url, "levels": runs,
              "probe": probe(target, args, workers, args.seed + 100 * index + 99)}  # fmt: skip
    shares = "/".join(f"{v:.0%}" for v in result["probe"]["token_share"].values())
    print(f"[routers] {contender.label} probe ({PROBE_REQUESTS} requests, one prefix): worker token shares {shares}",
          file=sys.stderr, flush=True)  # fmt: skip
    return result


def warm_up(base_urls: Sequence[str], model: str) -> None:
    """A couple of short random requests to each ``/v1`` base URL (first-run costs out of the way)."""
    rng = random.Random(4242)
    for url in base_urls:
        target = Target(url, model)
        requests = [shared_prefix(1, 1, 0, 64, 4, seed=rng.randrange(1 << 30))[0] for _ in range(WARMUP_REQUESTS)]
        asyncio.run(run(target, requests, 1, None, 0, True))


# --- the comparison ---------------------------------------------------------------------------------


def conductor_policy(overrides: Sequence[str]) -> str:
    """The Conductor's policy after ``--set`` overrides (the config's default otherwise)."""
    policy = "kvcache_centric"
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() == "scheduler.policy":
            policy = value.strip().strip("\"'")
    return policy


@contextmanager
def cluster_manifest(args: argparse.Namespace, root: Path, deployment: str) -> Iterator[dict[str, Any]]:
    """cluster.json of the cluster to use: ``--cluster-json``'s (colocated only), or one started here."""
    if args.cluster_json and deployment == "colocated":
        yield json.loads(Path(args.cluster_json).read_text())
        return
    overrides = [*args.model_overrides, *args.set, *DEPLOYMENTS[deployment](args.workers)]
    print(f"[routers] starting the {deployment} cluster ({' '.join(overrides)}) ...", file=sys.stderr, flush=True)
    with local_cluster(args.config, overrides, root / deployment) as cluster:
        print(f"[routers] cluster ready in {cluster.startup_s:.1f} s", file=sys.stderr, flush=True)
        yield {**json.loads((cluster.run_dir / "cluster.json").read_text()), "startup_s": cluster.startup_s}


def _one(contender: Contender, i: int, args: argparse.Namespace, front: dict[str, Any], root: Path) -> dict[str, Any]:
    """One contender against a deployment that is up: ``front`` holds its workers and how to reach them."""
    if contender.router is None:
        return run_contender(contender, i, args, front["rest"], front["workers"])
    log = root / f"{contender.router}-{contender.policy}.log"
    print(f"[routers] starting {contender.label} (log {log}) ...", file=sys.stderr, flush=True)
    with running_router(contender, front["router_args"], log) as base_url:
        if contender.deployment != "colocated":
            warm_up([base_url], args.model)
        result = run_contender(contender, i, args, base_url, front["workers"])
    result["log"] = str(log)
    return result


@contextmanager
def deployment_up(deployment: str, args: argparse.Namespace, root: Path) -> Iterator[dict[str, Any]]:
    """Bring one deployment up and warm it; yields its workers, gateway URL, router arguments, start-up time."""
    if deployment == "vllm-pd":
        t0 = time.monotonic()
        with stock_vllm_pd(args, root / deployment) as router_args:
            yield {"workers": [], "rest": None, "router_args": router_args, "startup_s": time.monotonic() - t0}
        return
    with cluster_manifest(args, root, deployment) as manifest:
        workers = cluster_workers(manifest, deployment)
        print(f"[routers] {deployment} workers: {', '.join(w.instance_id for w in workers)}", file=sys.stderr,
              flush=True)  # fmt: skip
        rest = manifest["rest"].rstrip("/")
        warm_up([w.openai_url + "/v1" for w in workers] if deployment == "colocated" else [rest], args.model)
        yield {"workers": workers, "rest": rest, "startup_s": manifest.get("startup_s"),
               "router_args": ["--worker-urls", *(w.openai_url for w in workers)]}  # fmt: skip


def compare_routers(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every contender, deployment by deployment (each started after the last one stopped); the JSON record."""
    contenders = [parse_contender(spec, conductor_policy(args.set)) for spec in args.contenders]
    if any(c.deployment == "vllm-pd" for c in contenders) and args.engine != "vllm":
        raise ValueError("vllm-pd contenders need --engine vllm (vllm-router drives vLLM servers)")
    results: dict[str, Any] = {}
    deployments: dict[str, Any] = {}
    for deployment in dict.fromkeys(c.deployment for c in contenders):
        with deployment_up(deployment, args, root) as front:
            deployments[deployment] = {"workers": [vars(w) for w in front["workers"]], "startup_s": front["startup_s"]}
            for i, contender in enumerate(contenders):
                if contender.deployment != deployment:
                    continue
                missing = contender.router and router_available(contender.router)
                if missing:
                    results[contender.spec] = {"label": contender.label, "skipped": missing}
                    print(f"[routers] skipping {contender.label}: {missing}", file=sys.stderr, flush=True)
                    continue
                try:
                    results[contender.spec] = _one(contender, i, args, front, root)
                except (RuntimeError, ValueError, httpx.HTTPError) as e:
                    results[contender.spec] = {"label": contender.label, "failed": f"{type(e).__name__}: {e}"}
                    print(f"[routers] {contender.label} failed: {e}", file=sys.stderr, flush=True)
                if contender.spec == "vllm:kv_aware" and "levels" in results[contender.spec]:
                    results[contender.spec]["note"] = KV_AWARE_NOTE
    return {"deployments": deployments, "contenders": results}


def table(record: dict[str, Any], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{"sglang-router cache_aware c=4": summary, ...}``, levels (``Level.label``) outermost."""
    ran = [r for r in record["contenders"].values() if "levels" in r]
    return {f"{r['label']} {level}": r["levels"][level]["summary"] for level in labels for r in ran}


def workers_markdown(record: dict[str, Any], labels: Sequence[str]) -> str:
    """Per contender and level: each worker's share of the prompt tokens and its engine hit rate; the probe."""
    ran = [r for r in record["contenders"].values() if "levels" in r]
    ids = list(dict.fromkeys(i for r in ran for level in r["levels"].values() for i in level["workers"]))
    head = ("| run | " + " | ".join(f"{i} tokens / hit" for i in ids) + " | probe: one prefix, "
            f"{PROBE_REQUESTS} requests |\n|---|" + "---:|" * (len(ids) + 1) + "\n")  # fmt: skip
    rows = []
    for r in ran:
        shares = r["probe"]["token_share"]
        probe_cell = " / ".join(f"{shares[i]:.0%}" if i in shares else "-" for i in ids)
        for level in labels:
            w = r["levels"][level]["workers"]
            cells = [f"{w[i]['token_share']:.0%} / {w[i]['hit_rate']:.0%}" if i in w else "-" for i in ids]
            rows.append(f"| {r['label']} {level} | " + " | ".join(cells) + f" | {probe_cell} |\n")
    return head + "".join(rows)


def markdown(record: dict[str, Any], title: str, labels: Sequence[str]) -> str:
    """routers.md: the table, what the workers saw, what was skipped or failed."""
    lines = [f"{title}; code {record['code']}; `{record['command']}`\n", report.markdown_table(table(record, labels)),
             "\nWhat the workers saw (their own /metrics: share of the prompt tokens each engine looked up, and "
             "its prefix-cache hit rate; probe: shares of a prefix sent 4 times in a row; - where a contender ran "
             "on other workers, and none for stock vLLM servers):\n",
             workers_markdown(record, labels)]  # fmt: skip
    for r in record["contenders"].values():
        for key in ("skipped", "failed", "note"):
            if key in r:
                lines.append(f"- {r['label']}: {key}: {r[key]}\n")
    return "\n".join(lines)


def colors(labels: Sequence[str]) -> list[str]:
    """One colour per front end: ours blue, sglang-router greens, vllm-router oranges."""
    palette = {"conductor": ["#4C72B0", "#1F3A68"], "sglang-router": ["#55A868", "#8FD19E", "#2E6B3F"],
               "vllm-router": ["#DD8452", "#F2B880", "#A0522D", "#C44E52"]}  # fmt: skip
    seen: dict[str, list[str]] = {}
    out = []
    for label in labels:
        name = label.rsplit(" c=", 1)[0]
        family = name.split(" ")[0]
        names = seen.setdefault(family, [])
        if name not in names:
            names.append(name)
        shades = palette.get(family, ["#937860"])
        out.append(shades[names.index(name) % len(shades)])
    return out


def main(args: argparse.Namespace, out: Path, root: Path, code: str) -> dict[str, Any]:
    """Run the comparison and write ``routers.{json,md,png}``; the JSON record."""
    t0 = time.monotonic()
    result = compare_routers(args, root)
    record = {"kind": "routers", "code": code, "command": args.command_line, "wall_s": time.monotonic() - t0, **result,
              "workload": {k: getattr(args, k) for k in ("workload", "endpoint", "num_requests", "num_prefixes",
                           "suffixes_per_prefix", "prefix_len", "suffix_len", "output_len", "seed", "concurrency",
                           "request_rates", "ttft_slo_ms", "tpot_slo_ms")}, "overrides": args.set}  # fmt: skip
    labels = [level.label for level in levels(args)]
    runs = table(record, labels)
    if not runs:
        raise RuntimeError("no contender ran: " + "; ".join(
            f"{r['label']}: {r.get('skipped') or r.get('failed')}" for r in record["contenders"].values()))  # fmt: skip
    title = (f"bench compare --routers: {args.workload}, {args.num_requests} requests over {args.num_prefixes} "
             f"prefixes, {args.engine} engine, {args.workers} worker slots of one engine each behind every "
             "front end")  # fmt: skip
    (out / "routers.json").write_text(json.dumps(metrics.jsonable(record), indent=2, default=str) + "\n")
    (out / "routers.md").write_text(markdown(record, title, labels))
    report.plot(runs, out / "routers.png", title, colors=colors(list(runs)))
    print(report.text_table(runs))
    print(workers_markdown(record, labels))
    return record
