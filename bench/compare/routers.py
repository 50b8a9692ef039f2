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
  colocated worker serves itself, read from its etcd record), then stopped after its runs. A cluster that
  a ``vllm:kv_aware`` contender runs on has ``[engine] zmq_kv_events`` on (the others off: the feed costs
  the workers' event loops about 1 ms per 12k-token prompt), so ``vllm:kv_aware`` subscribes to every
  worker's KV events in vLLM's ZMQ format (``--kv-event-source URL=ENDPOINT``, the endpoint from the
  worker's etcd record). Every cluster runs with ``[scheduler] worker_endpoint_admission`` off: a worker's
  own endpoint queues every request as a stock vLLM or SGLang server does
  (``--set scheduler.worker_endpoint_admission=true`` gives the peers our
  per-worker SLO admission, whose 429s sglang-router's circuit breaker counts as worker failures).

Two more deployments use the same two worker slots (one engine each), started after the colocated cluster
is stopped:

- ``conductor:disaggregated``: a prefill/decode cluster (one prefill, one decode worker) behind our
  gateway: the Conductor's Algorithm 1 with KV moving prefill -> decode;
- ``conductor:conditional``: the same split of prefill workers beside colocated ones (no decode workers):
  each request prefills on a prefill worker or on the colocated worker that decodes it, by
  ``[scheduler] disaggregation`` (``--set scheduler.disaggregation='"dynamo"'`` runs Dynamo's rule there);
- ``vllm-pd:POLICY`` (``--engine vllm`` only): ``vllm-router``'s own prefill/decode mode
  (``--vllm-pd-disaggregation --kv-connector mooncake``) over two stock vLLM OpenAI servers that run our
  workers' engine arguments (``bench/compare/vllm_server.py``): vllm-router passes ``kv_transfer_params``
  over HTTP, which our gRPC workers do not take, so it drives vLLM's own servers instead.

On the emulated engine (``--engine emulated``) Dynamo's own stack runs too, on its own mocker engines
with the same profile and engine shape (``bench/compare/dynamo_live.py``): ``dynamo:POLICY`` aggregated on
the colocated deployment's slots, ``dynamo-pd:POLICY`` disaggregated on the same prefill/decode split as
``conductor:disaggregated``.

Every contender gets the same workload shape at the same concurrency levels, or, with ``--capacity LO HI``,
its SLO capacity is bisected (``bench/compare/capacity.py``: each contender runs the rates its own bisection
picks, ``--repeats`` times). Prompts are fresh for
every (contender, level) (seed ``--seed + 100 * contender + level``), so no contender finds the prefixes
of an earlier one in the workers' caches: each starts as cold as the first. The request order is
shuffled (seeded): the shared-prefix workload is ordered round-robin over its prefixes, so with as many
prefixes as workers a round-robin router would send each prefix to one worker and look cache-aware.

Beside the client-side table (TTFT, TPOT, hit rate from ``usage.prompt_tokens_details.cached_tokens``,
throughput, goodput) each run records what the workers saw, from their own ``/metrics``: the share of
prompt tokens each worker's engine looked up and its prefix-cache hits. After the levels a probe
sends ``PROBE_REQUESTS`` sequential requests that share one fresh prefix: a cache-aware router sends
them all to one worker, a round-robin one spreads them.

Writes ``routers.json`` (summaries), ``requests.jsonl`` (every request of every run), ``routers.md`` and
``routers.png`` under ``--out``; logs of the cluster and of every router under ``runs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.compare import capacity, report
from bench.compare.cluster import colocated, conditional, disaggregated
from bench.compare.dynamo_live import dynamo_frontend, dynamo_workers
from bench.compare.peers import (
    KV_AWARE_NOTE,
    Contender,
    parse_contender,
    router_available,
    running_router,
    stock_vllm_pd,
)
from bench.compare.worker_metrics import WorkerInfo, cluster_workers, scrape_all, worker_deltas
from bench.serve import metrics
from bench.serve.cli import build_workload
from bench.serve.runner import Target, check_target, run
from bench.serve.workloads import shared_prefix
from cli.local_cluster import local_cluster

DEFAULT_CONTENDERS = {
    "builtin": ("conductor", "sglang:cache_aware", "sglang:round_robin", "vllm:cache_aware", "vllm:power_of_two",
                "vllm:kv_aware"),
    "vllm": ("conductor", "conductor:disaggregated", "sglang:cache_aware", "vllm:cache_aware", "vllm:power_of_two",
             "vllm-pd:cache_aware"),
    "emulated": ("conductor", "conductor:disaggregated", "sglang:cache_aware", "vllm:cache_aware", "vllm:kv_aware",
                 "dynamo:kv", "dynamo-pd:kv"),
}  # fmt: skip
PROBE_REQUESTS = 4
WARMUP_REQUESTS = 2

# --- one contender ----------------------------------------------------------------------------------


def workload(args: argparse.Namespace, seed: int) -> list[Any]:
    """``bench serve``'s workload for these flags and seed, in a seeded shuffled order."""
    requests = build_workload(argparse.Namespace(**{**vars(args), "seed": seed}))
    random.Random(seed).shuffle(requests)
    return requests


@dataclass(frozen=True)
class Level:
    """One load level: closed loop at ``concurrency`` or open loop at ``rate`` requests/s (Poisson); ``repeat``
    numbers the bisections of ``--capacity`` (the first is 1)."""

    concurrency: int | None = None
    rate: float | None = None
    repeat: int = 1

    @property
    def label(self) -> str:
        """``c=4``, ``rate=2.5`` or, in a second bisection, ``rate=2.5 #2``."""
        label = f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}"
        return label + (f" #{self.repeat}" if self.repeat > 1 else "")


def levels(args: argparse.Namespace) -> list[Level]:
    """``--request-rates`` (open loop) when given, else ``--concurrency`` (closed loop); none with ``--capacity``
    (each contender's bisection picks its own rates)."""
    if getattr(args, "capacity", None):
        return []
    if getattr(args, "request_rates", None):
        return [Level(rate=r) for r in args.request_rates]
    return [Level(concurrency=c) for c in args.concurrency]


def run_level(target: Target, args: argparse.Namespace, level: Level, seed: int) -> dict[str, Any]:
    """One run at ``level``; the record ``bench serve`` writes, plus the seed."""
    requests = workload(args, seed)
    results, duration = asyncio.run(run(target, requests, level.concurrency, level.rate, seed, args.quiet))
    summary = metrics.summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms, args.tbt_slo_ms)
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

    def one_level(level: Level, seed: int) -> dict[str, Any]:
        print(f"[routers] {contender.label} {level.label}: running ...", file=sys.stderr, flush=True)
        before = scrape_all(workers)
        record = run_level(target, args, level, seed)
        record["workers"] = worker_deltas(before, scrape_all(workers))
        runs[level.label] = record
        s = record["summary"]
        shares = "/".join(f"{d['token_share']:.0%}" for d in record["workers"].values())
        print(f"[routers] {contender.label} {level.label}: TTFT p50 {s['ttft_ms']['median']:.1f} ms, TBT p90 "
              f"{s['tbt_ms']['p90']:.1f} ms ({s['tbt_per_token']:.0%} per token), "
              f"hit {s['prefix_cache_hit_rate']:.1%}, "
              f"{s['completed']}/{s['requests']} done, {s['slo_attainment']:.0%} within SLO, "
              f"worker token shares {shares}",
              file=sys.stderr, flush=True)  # fmt: skip
        return record

    result: dict[str, Any] = {"label": contender.label, "spec": contender.spec, "base_url": base_url, "levels": runs}
    for j, level in enumerate(levels(args)):
        one_level(level, args.seed + 100 * index + j)
    if getattr(args, "capacity", None):
        result["capacity"] = [bisect_levels(contender, index, repeat, args, one_level)
                              for repeat in range(1, args.repeats + 1)]  # fmt: skip
    result["probe"] = probe(target, args, workers, args.seed + 100 * index + 99)
    shares = "/".join(f"{v:.0%}" for v in result["probe"]["token_share"].values())
    print(f"[routers] {contender.label} probe ({PROBE_REQUESTS} requests, one prefix): worker token shares {shares}",
          file=sys.stderr, flush=True)  # fmt: skip
    return result


def bisect_levels(
    contender: Contender,
    index: int,
    repeat: int,
    args: argparse.Namespace,
    one_level: Callable[[Level, int], dict[str, Any]],
) -> dict[str, Any]:
    """One bisection of ``contender``'s SLO capacity in ``--capacity LO HI`` (``bench/compare/capacity.py``);
    each probe is a level run with its own seed (fresh prompts and arrivals in every repeat)."""
    seeds = iter(range(args.seed + 100 * index + 1000 * repeat, args.seed + 100 * index + 1000 * repeat + 100))

    def attainment(rate: float) -> float:
        return float(one_level(Level(rate=rate, repeat=repeat), next(seeds))["summary"]["slo_attainment"])

    lo, hi = args.capacity
    found = capacity.bisect(attainment, lo, hi, args.tolerance).record()
    print(f"[routers] {contender.label} capacity (bisection {repeat}): {capacity.describe(found)} req/s",
          file=sys.stderr, flush=True)  # fmt: skip
    return found


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


def deployment_overrides(deployment: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The node counts of one of our deployments on ``--workers`` slots (``--prefill-workers`` of them prefill)."""
    if deployment == "colocated":
        return colocated(args.workers)
    if deployment == "conditional":
        return conditional(args.workers, args.prefill_workers)
    return disaggregated(args.workers, args.prefill_workers)


@contextmanager
def cluster_manifest(
    args: argparse.Namespace, root: Path, deployment: str, kv_events: bool
) -> Iterator[dict[str, Any]]:
    """cluster.json of the cluster to use: ``--cluster-json``'s (colocated only), or one started here.

    ``kv_events``: the workers also publish their KV events in vLLM's ZMQ format, for vllm-router's kv_aware
    policy. Only where such a contender runs: building that feed takes a worker's event loop about 1 ms per
    12k-token prompt (on an idle core), which the other contenders on the cluster would pay for nothing.
    """
    if args.cluster_json and deployment == "colocated":
        yield json.loads(Path(args.cluster_json).read_text())
        return
    # the workers' own OpenAI endpoints admit everything, as the stock servers the peer routers are built for do
    feed = ["engine.zmq_kv_events=true"] if kv_events else []
    overrides = [*args.model_overrides, *feed, "scheduler.worker_endpoint_admission=false", *args.set,
                 *deployment_overrides(deployment, args)]  # fmt: skip
    print(f"[routers] starting the {deployment} cluster ({' '.join(overrides)}) ...", file=sys.stderr, flush=True)
    with local_cluster(args.config, overrides, root / deployment) as cluster:
        print(f"[routers] cluster ready in {cluster.startup_s:.1f} s", file=sys.stderr, flush=True)
        yield {**json.loads((cluster.run_dir / "cluster.json").read_text()), "startup_s": cluster.startup_s,
               "overrides": overrides}  # fmt: skip


def _one(contender: Contender, i: int, args: argparse.Namespace, front: dict[str, Any], root: Path) -> dict[str, Any]:
    """One contender against a deployment that is up: ``front`` holds its workers and how to reach them."""
    if contender.router is None:
        return run_contender(contender, i, args, front["rest"], front["workers"])
    log = root / f"{contender.router}-{contender.policy}.log"
    if contender.router in ("dynamo", "dynamo-pd"):
        print(f"[routers] starting {contender.label}'s frontend (log {log}) ...", file=sys.stderr, flush=True)
        with dynamo_frontend(contender.policy, args.model, front["store"], log, args.workers) as base_url:
            warm_up([base_url], args.model)
            result = run_contender(contender, i, args, base_url, front["workers"])
        return result | {"log": str(log)}
    print(f"[routers] starting {contender.label} (log {log}) ...", file=sys.stderr, flush=True)
    router_args = front["router_args"] + (front["kv_event_args"] if contender.spec == "vllm:kv_aware" else [])
    with running_router(contender, router_args, log) as base_url:
        if contender.deployment != "colocated":
            warm_up([base_url], args.model)
        result = run_contender(contender, i, args, base_url, front["workers"])
    result["log"] = str(log)
    return result


def _guarded(
    contender: Contender, i: int, args: argparse.Namespace, front: dict[str, Any], root: Path
) -> dict[str, Any]:
    """``_one``, with a contender's failure recorded instead of raised (the others still run)."""
    try:
        result = _one(contender, i, args, front, root)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"[routers] {contender.label} failed: {e}", file=sys.stderr, flush=True)
        return {"label": contender.label, "failed": f"{type(e).__name__}: {e}"}
    if contender.spec == "vllm:kv_aware" and not front["kv_event_args"]:
        result["note"] = KV_AWARE_NOTE
    return result


def kv_event_args(workers: Sequence[WorkerInfo], model: str) -> list[str]:
    """vllm-router's flags that subscribe it to each worker's ZMQ KV events (none if the workers publish none)."""
    sources = [f"{w.openai_url}={w.kv_events_endpoint}" for w in workers if w.kv_events_endpoint]
    if not sources:
        return []
    return [*(a for s in sources for a in ("--kv-event-source", s)), "--kv-event-block-size",
            str(workers[0].block_size), "--kv-event-model", model]  # fmt: skip


@contextmanager
def deployment_up(
    deployment: str, args: argparse.Namespace, root: Path, kv_events: bool = False
) -> Iterator[dict[str, Any]]:
    """Bring one deployment up and warm it; yields its workers, gateway URL, router arguments, start-up time.

    ``kv_events``: its workers publish KV events in vLLM's ZMQ format (``cluster_manifest``)."""
    if deployment in ("dynamo", "dynamo-pd"):
        t0 = time.monotonic()
        with dynamo_workers(args, root / deployment, deployment) as store:
            yield {"workers": [], "rest": None, "router_args": [], "kv_event_args": [], "store": store,
                   "startup_s": time.monotonic() - t0}  # fmt: skip
        return
    if deployment == "vllm-pd":
        t0 = time.monotonic()
        with stock_vllm_pd(args, root / deployment) as router_args:
            yield {"workers": [], "rest": None, "router_args": router_args, "kv_event_args": [],
                   "startup_s": time.monotonic() - t0}  # fmt: skip
        return
    with cluster_manifest(args, root, deployment, kv_events) as manifest:
        workers = cluster_workers(manifest, deployment)
        print(f"[routers] {deployment} workers: {', '.join(w.instance_id for w in workers)}", file=sys.stderr,
              flush=True)  # fmt: skip
        rest = manifest["rest"].rstrip("/")
        warm_up([w.openai_url + "/v1" for w in workers] if deployment == "colocated" else [rest], args.model)
        yield {"workers": workers, "rest": rest, "startup_s": manifest.get("startup_s"),
               "overrides": manifest.get("overrides", []),
               "router_args": ["--worker-urls", *(w.openai_url for w in workers)],
               "kv_event_args": kv_event_args(workers, args.model)}  # fmt: skip


def compare_routers(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every contender, deployment by deployment (each started after the last one stopped); the JSON record."""
    contenders = [parse_contender(spec, conductor_policy(args.set)) for spec in args.contenders]
    if any(c.deployment == "vllm-pd" for c in contenders) and args.engine != "vllm":
        raise ValueError("vllm-pd contenders need --engine vllm (vllm-router drives vLLM servers)")
    if any(c.router in ("dynamo", "dynamo-pd") for c in contenders) and args.engine != "emulated":
        raise ValueError("dynamo contenders need --engine emulated (Dynamo's mocker runs the emulated profile)")
    results: dict[str, Any] = {}
    runnable = []
    for i, contender in enumerate(contenders):
        missing = contender.router and router_available(contender.router)
        if missing:
            results[contender.spec] = {"label": contender.label, "skipped": missing}
            print(f"[routers] skipping {contender.label}: {missing}", file=sys.stderr, flush=True)
        else:
            runnable.append((i, contender))
    deployments: dict[str, Any] = {}
    for deployment in dict.fromkeys(c.deployment for _, c in runnable):
        mine = [(i, c) for i, c in runnable if c.deployment == deployment]
        try:
            kv_events = any(c.spec == "vllm:kv_aware" for _, c in mine)
            with deployment_up(deployment, args, root, kv_events) as front:
                deployments[deployment] = {"workers": [vars(w) for w in front["workers"]],
                                           "startup_s": front["startup_s"],
                                           "overrides": front.get("overrides", [])}  # fmt: skip
                for i, contender in mine:
                    results[contender.spec] = _guarded(contender, i, args, front, root)
        except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:  # the deployment itself failed
            print(f"[routers] the {deployment} deployment failed: {e}", file=sys.stderr, flush=True)
            for _, contender in mine:
                results.setdefault(
                    contender.spec,
                    {"label": contender.label, "failed": f"{deployment} deployment: {type(e).__name__}: {e}"},
                )
    return {"deployments": deployments, "contenders": results}


def run_labels(record: dict[str, Any]) -> list[str]:
    """Every level label that some contender ran, in the order they ran (with ``--capacity`` each contender's
    bisection ran its own rates)."""
    return list(dict.fromkeys(label for r in record["contenders"].values() for label in r.get("levels", {})))


def table(record: dict[str, Any], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{"sglang-router cache_aware c=4": summary, ...}``, levels (``Level.label``) outermost."""
    ran = [r for r in record["contenders"].values() if "levels" in r]
    return {f"{r['label']} {level}": r["levels"][level]["summary"] for level in labels for r in ran
            if level in r["levels"]}  # fmt: skip


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
        for level in (label for label in labels if label in r["levels"]):
            w = r["levels"][level]["workers"]
            cells = [f"{w[i]['token_share']:.0%} / {w[i]['hit_rate']:.0%}" if i in w else "-" for i in ids]
            rows.append(f"| {r['label']} {level} | " + " | ".join(cells) + f" | {probe_cell} |\n")
    return head + "".join(rows)


def markdown(record: dict[str, Any], title: str, swept: Sequence[Level]) -> str:
    """routers.md: the table, what the workers saw, the SLO capacities of a rate sweep or of ``--capacity``'s
    bisections, what was skipped or failed."""
    labels = [level.label for level in swept] or run_labels(record)
    lines = [f"{title}; code {record['code']}; `{record['command']}`\n", report.markdown_table(table(record, labels)),
             "\nWhat the workers saw (their own /metrics: share of the prompt tokens each engine looked up, and "
             "its prefix-cache hit rate; probe: shares of a prefix sent 4 times in a row; - where a contender ran "
             "on other workers, and none for stock vLLM servers):\n",
             workers_markdown(record, labels)]  # fmt: skip
    rates = [level.rate for level in swept if level.rate is not None]
    if swept and len(rates) == len(swept):
        ran = [r for r in record["contenders"].values() if "levels" in r]
        by_rate = {r["label"]: {rate: r["levels"][level.label]["summary"] for rate, level in zip(rates, swept,
                   strict=True)} for r in ran}  # fmt: skip
        peers = [r["label"] for r in ran if not r["spec"].startswith("conductor")]
        lines.append("\n" + report.capacity_markdown(by_rate, peers))
    pd = {spec for spec in record["contenders"] if parse_contender(spec).deployment not in ("colocated", "dynamo")}
    if bisected := capacity.markdown(record["contenders"], pd):
        lines.append("\n" + bisected)
    if knees := capacity.knee_markdown(record["contenders"]):
        lines.append("\n" + knees)
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


def write_requests(record: dict[str, Any], path: Path) -> None:
    """Move every run's per-request records out of ``record`` into ``path``, one JSON line per request.

    ``routers.json`` keeps the summaries (a 400-request rate sweep's records are megabytes; git ignores
    ``requests.jsonl``); the lines name their contender and level, for a closer look at one run.
    """
    with path.open("w") as f:
        for label, contender in record["contenders"].items():
            for level, run in contender.get("levels", {}).items():
                for r in run.pop("requests", []):
                    f.write(json.dumps(metrics.jsonable({"contender": label, "level": level, **r}), default=str) + "\n")


def main(args: argparse.Namespace, out: Path, root: Path, code: str) -> dict[str, Any]:
    """Run the comparison and write ``routers.{json,md,png}``; the JSON record."""
    t0 = time.monotonic()
    result = compare_routers(args, root)
    record = {"kind": "routers", "code": code, "command": args.command_line, "wall_s": time.monotonic() - t0, **result,
              "workload": {k: getattr(args, k) for k in ("workload", "endpoint", "num_requests", "num_prefixes",
                           "suffixes_per_prefix", "prefix_len", "suffix_len", "output_len", "trace", "limit", "seed",
                           "concurrency", "request_rates", "capacity", "tolerance", "repeats", "ttft_slo_ms",
                           "tpot_slo_ms", "tbt_slo_ms", "prefill_workers")},
              "overrides": args.set}  # fmt: skip
    swept = levels(args)
    labels = [level.label for level in swept] or run_labels(record)
    runs = table(record, labels)
    if not runs:
        raise RuntimeError("no contender ran: " + "; ".join(
            f"{r['label']}: {r.get('skipped') or r.get('failed')}" for r in record["contenders"].values()))  # fmt: skip
    shape = (f"the first {args.limit} requests of {Path(args.trace).name}" if args.workload == "trace" else
             f"{args.workload}, {args.num_requests} requests over {args.num_prefixes} prefixes")  # fmt: skip
    title = (f"bench compare --routers: {shape}, {args.engine} engine, {args.workers} worker slots of one engine "
             "each behind every front end")  # fmt: skip
    write_requests(record, out / "requests.jsonl")
    (out / "routers.json").write_text(json.dumps(metrics.jsonable(record), indent=2, default=str) + "\n")
    (out / "routers.md").write_text(markdown(record, title, swept))
    report.plot(runs, out / "routers.png", title, colors=colors(list(runs)))
    print(report.text_table(runs))
    print(workers_markdown(record, labels))
    return record
