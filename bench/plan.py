"""``kvconductor plan``: size a cluster with the simulator, the live Conductor's core, before running it.

    kvconductor plan --rate 6 --ttft-slo-ms 5000 --tbt-slo-ms 300          # the smallest cluster for 6 req/s
    kvconductor plan --instances 16 --ttft-slo-ms 5000 --tbt-slo-ms 300    # the most 16 instances serve
    kvconductor plan --instances 8 --trace T.jsonl --profile-json gpu.json --out /tmp/plan

Every deployment of N instances is a candidate: colocated (N colocated instances), disaggregated (P prefill +
N-P decode) and conditional (P prefill + N-P colocated, each request prefilled where the ``[scheduler]
disaggregation`` rule says: ``scheduler/disaggregation.py``). A candidate's SLO capacity is the highest rate
at which at least 90% of the trace's requests meet both SLOs, admission on (a rejection is a miss), found by
bisection (``bench/compare/capacity.py``) over the trace replayed faster or slower (its arrivals scaled).

``--rate R``: N grows from ``--min-instances`` until a candidate meets the SLOs at R; every candidate of that N
is then ranked by its capacity, and the best one is chosen. ``--instances N``: every candidate of N is ranked.
Then the seed's tuning order is walked for the chosen one, one knob at a time, keeping a value only when it
raises the capacity: ``[scheduler] kv_cache_balancing_threshold``, ``max_num_batched_tokens`` (the prefill
chunk), ``max_concurrent_requests`` (per decode instance).

Writes under ``--out``: ``plan.toml`` (node counts, SLOs and the tuned knobs: ``kvconductor up --config
plan.toml`` or deploy/k8s's config.toml take it as it is), ``plan.json`` (every candidate's bisection) and
``plan.png``. What the simulator does not model (the learning of cost models, the Conductor's own cost, the
machine's noise) it does not predict: ``kvconductor bench compare --engine emulated --routers --capacity``
measures a deployment live.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.compare.capacity import EXPANSIONS, TOLERANCE, Bisection
from bench.compare.report import ATTAINMENT
from bench.provenance import command_line, fresh_out, git_state
from bench.sim.common import write_json
from scheduler.policy import DISAGGREGATION
from scheduler.profiles import PROFILES, Profile, named_profile
from scheduler.sim.metrics import tbt_of
from scheduler.sim.simulator import SimConfig, Simulator
from scheduler.sim.trace import DEFAULT_TRACE, TraceRequest, load_trace

DEPLOYMENTS = ("colocated", "disaggregated", "conditional")
_EMPTY = np.empty(0)  # the step log of a request that never decoded
BRACKET_STEPS = 10  # doublings (or halvings) from the first rate in search of the capacity's bracket
# The seed's tuning order after the split, with the values tried (the profile's own value is always one).
TUNING = {
    "kv_cache_balancing_threshold": (1.5, 2.0, 4.0, 8.0),
    "max_num_batched_tokens": (2048, 4096, 8192, 16384),
    "max_concurrent_requests": (32, 64, 128, 256),
}


@dataclass(frozen=True)
class Knobs:
    """The tuned values: the balancing threshold, the prefill chunk and the decode batch limit."""

    kv_cache_balancing_threshold: float
    max_num_batched_tokens: int
    max_concurrent_requests: int


@dataclass(frozen=True)
class Candidate:
    """One deployment: ``prefill`` prefill instances and ``other`` decode (disaggregated) or colocated ones."""

    deployment: str
    prefill: int
    other: int

    @property
    def instances(self) -> int:
        """Instances in all."""
        return self.prefill + self.other

    @property
    def label(self) -> str:
        """``16 colocated``, ``12P+4D`` or ``8P+8C``."""
        if self.deployment == "colocated":
            return f"{self.other} colocated"
        return f"{self.prefill}P+{self.other}{'D' if self.deployment == 'disaggregated' else 'C'}"

    def node_counts(self) -> dict[str, int]:
        """``node_count`` of each pool."""
        decode = self.other if self.deployment == "disaggregated" else 0
        colocated = 0 if self.deployment == "disaggregated" else self.other
        return {"prefill": self.prefill, "decode": decode, "colocated": colocated}


@dataclass(frozen=True)
class Bed:
    """What every simulated run shares: the trace, the profile and the SLOs."""

    trace: Path
    limit: int | None
    max_output_tokens: int | None
    profile: Profile
    max_ttft: float
    max_tbt: float
    disaggregation: str
    prediction_error: float
    seed: int
    base_rate: float  # the trace's own request rate, req/s

    def attainment(self, candidate: Candidate, knobs: Knobs, rate: float) -> float:
        """Share of the trace's requests within both SLOs at ``rate`` req/s (admission on: rejections miss)."""
        requests = load_trace(self.trace, rate / self.base_rate, self.limit, self.max_output_tokens)
        profile = replace(self.profile, chunk_tokens=knobs.max_num_batched_tokens,
                          max_running=knobs.max_concurrent_requests)  # fmt: skip
        colocated = candidate.deployment == "colocated"
        config = SimConfig(
            policy="colocated" if colocated else "conditional" if candidate.deployment == "conditional" else
            "kvcache_centric",
            num_prefill=candidate.other // 2 if colocated else candidate.prefill,
            num_decode=candidate.other - candidate.other // 2 if colocated else candidate.other,
            max_ttft=self.max_ttft, max_tbt=self.max_tbt, reject=True, seed=self.seed,
            kv_cache_balancing_threshold=knobs.kv_cache_balancing_threshold, disaggregation=self.disaggregation,
            prediction_error=self.prediction_error,
        )  # fmt: skip
        result = Simulator(config, profile, requests).run()
        good = sum(
            1
            for r in result.records
            if r.served
            and r.first_token - r.arrival <= self.max_ttft
            and tbt_of(r, result.step_logs.get(r.decode_instance, _EMPTY)) <= self.max_tbt
        )
        return good / max(1, len(result.records))

    def capacity(self, candidate: Candidate, knobs: Knobs, around: float) -> Bisection:
        """The candidate's SLO capacity to within 5%: a bracket found by doubling (or halving) from ``around``,
        then bisected (``bench/compare/capacity.py``); at most ``BRACKET_STEPS`` doublings each way."""
        rate = max(0.01, round(around, 2))
        share = self.attainment(candidate, knobs, rate)
        probes, step = {rate: share}, 2.0 if share >= ATTAINMENT else 0.5
        for _ in range(BRACKET_STEPS):
            rate = max(0.01, round(rate * step, 2))
            probes[rate] = self.attainment(candidate, knobs, rate)
            if (probes[rate] >= ATTAINMENT) != (share >= ATTAINMENT):
                break
        search = Bisection(min(probes), max(probes), probes, expansions=EXPANSIONS)  # the bracket is known
        while (probe := search.next_rate(TOLERANCE)) is not None:
            search.probes[probe] = self.attainment(candidate, knobs, probe)
        return search


def candidates(n: int, deployments: Sequence[str]) -> list[Candidate]:
    """Every deployment of ``n`` instances (P from 1 to n-1 where there are two pools)."""
    found = [Candidate("colocated", 0, n)] if "colocated" in deployments and n >= 1 else []
    for deployment in ("disaggregated", "conditional"):
        if deployment in deployments:
            found += [Candidate(deployment, p, n - p) for p in range(1, n)]
    return found


def trace_rate(requests: Sequence[TraceRequest]) -> float:
    """Requests per second over the trace's span."""
    span = requests[-1].arrival - requests[0].arrival
    if len(requests) < 2 or span <= 0:
        raise ValueError("the trace needs at least two requests at different times")
    return (len(requests) - 1) / span


def _capacity_job(bed: Bed, candidate: Candidate, knobs: Knobs, around: float) -> dict[str, Any]:
    return bed.capacity(candidate, knobs, around).record()


def _attainment_job(bed: Bed, candidate: Candidate, knobs: Knobs, rate: float) -> float:
    return bed.attainment(candidate, knobs, rate)


class Planner:
    """The search, run ``jobs`` simulations at a time, with progress lines on stderr."""

    def __init__(self, bed: Bed, knobs: Knobs, jobs: int, quiet: bool = False) -> None:
        self.bed, self.knobs, self.jobs, self.quiet = bed, knobs, jobs, quiet
        self.t0 = time.monotonic()

    def say(self, message: str) -> None:
        """A progress line."""
        if not self.quiet:
            print(f"[plan {time.monotonic() - self.t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    def _map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        if self.jobs <= 1 or len(calls) <= 1:
            return [fn(*c) for c in calls]
        with ProcessPoolExecutor(min(self.jobs, len(calls))) as pool:
            return list(pool.map(fn, *zip(*calls, strict=True)))

    def capacities(self, found: list[Candidate], knobs: Knobs, around: float) -> list[dict[str, Any]]:
        """Each candidate's bisection record."""
        self.say(f"bisecting the SLO capacity of {len(found)} candidates from {around:.2f} req/s ...")
        records = self._map(_capacity_job, [(self.bed, c, knobs, around) for c in found])
        for c, r in zip(found, records, strict=True):
            self.say(f"  {c.label:>14}: {_describe(r)}")
        return records

    def smallest(self, rate: float, deployments: Sequence[str], lo_n: int, hi_n: int) -> list[dict[str, Any]]:
        """Instance counts from ``lo_n`` up, each with its best candidate's share within the SLOs at ``rate``,
        until one meets them (the last entry) or ``hi_n`` is passed."""
        search = []
        for n in range(lo_n, hi_n + 1):
            found = candidates(n, deployments)
            shares = self._map(_attainment_job, [(self.bed, c, self.knobs, rate) for c in found])
            share, label = max(zip(shares, (c.label for c in found), strict=True))
            search.append({"instances": n, "best": label, "attainment": share})
            self.say(f"{n} instances: best {label} with {share:.1%} within the SLOs at {rate:g} req/s")
            if share >= ATTAINMENT:
                break
        return search

    def tune(self, candidate: Candidate, capacity: float) -> tuple[Knobs, list[dict[str, Any]]]:
        """The seed's tuning order on ``candidate``: each knob's values, the best kept (ties keep the current)."""
        knobs, steps = self.knobs, []
        for knob, values in TUNING.items():
            tried = sorted({*values, getattr(knobs, knob)})
            variants = [replace(knobs, **{knob: v}) for v in tried]
            self.say(f"tuning {knob} on {candidate.label}: {', '.join(f'{v:g}' for v in tried)}")
            records = self._map(_capacity_job, [(self.bed, candidate, k, capacity or self.bed.base_rate)
                                                for k in variants])  # fmt: skip
            results = {v: r["capacity"] or 0.0 for v, r in zip(tried, records, strict=True)}
            best = max(tried, key=lambda v: (results[v], v == getattr(knobs, knob)))
            if results[best] > capacity:
                knobs, capacity = replace(knobs, **{knob: best}), results[best]
            steps.append({"knob": knob, "capacity": {f"{v:g}": c for v, c in results.items()},
                          "kept": getattr(knobs, knob)})  # fmt: skip
            self.say(f"  {knob} = {getattr(knobs, knob):g}: {capacity:.2f} req/s")
        return knobs, steps


def _describe(record: dict[str, Any]) -> str:
    if record["capacity"] is None:  # the share at the lowest rate says whether any rate would do
        share = record["probes"][f"{record['failing']:g}"]
        return f"below {record['failing']:g} req/s ({share:.0%} within the SLOs there)"
    bound = "at least " if record["at_least"] else ""
    return f"{bound}{record['capacity']:g} req/s"


def config_toml(candidate: Candidate, knobs: Knobs, bed: Bed, header: Sequence[str]) -> str:
    """The chosen deployment as a config the launcher and deploy/k8s take: every key this plan decided."""
    counts = candidate.node_counts()
    lines = [*(f"# {h}" for h in header), ""]
    pools = {"prefill": counts["prefill"], "decode": counts["decode"], "colocated": counts["colocated"]}
    for pool, count in pools.items():
        lines += [f"[{pool}]", f"node_count = {count}"]
        if count and pool in ("prefill", "colocated"):  # a conditional request's SLOs are [colocated]'s
            slo = pool == "colocated" or candidate.deployment == "disaggregated"
            lines += [f"max_ttft_ms = {bed.max_ttft * 1e3:g}"] * slo
            lines.append(f"max_num_batched_tokens = {knobs.max_num_batched_tokens}")
        if count and pool in ("decode", "colocated"):
            lines += [f"max_tbt_ms = {bed.max_tbt * 1e3:g}",
                      f"max_concurrent_requests = {knobs.max_concurrent_requests}"]  # fmt: skip
        lines.append("")
    lines += ["[scheduler]", f"kv_cache_balancing_threshold = {knobs.kv_cache_balancing_threshold:g}"]
    if candidate.deployment == "conditional":
        lines.append(f'disaggregation = "{bed.disaggregation}"')
    return "\n".join(lines) + "\n"


def plot(path: Path, ranked: list[tuple[Candidate, dict[str, Any]]], chosen: Candidate, rate: float | None) -> None:
    """Each candidate's predicted capacity, by deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"colocated": "tab:gray", "disaggregated": "tab:blue", "conditional": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(ranked)), 4.0))
    labels = [c.label for c, _ in ranked]
    values = [r["capacity"] or 0.0 for _, r in ranked]
    bars = ax.bar(labels, values, color=[colours[c.deployment] for c, _ in ranked])
    for bar, (c, _) in zip(bars, ranked, strict=True):
        if c == chosen:
            bar.set_edgecolor("black")
            bar.set_linewidth(2.0)
    if rate is not None:
        ax.axhline(rate, color="tab:red", linestyle="--", label=f"target {rate:g} req/s")
        ax.legend()
    ax.set_ylabel("predicted SLO capacity, req/s")
    ax.set_title(f"kvconductor plan: {ranked[0][0].instances} instances (chosen {chosen.label}, outlined)")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvconductor plan``."""
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--rate", type=float, metavar="R", help="target request rate, req/s: the smallest cluster")
    goal.add_argument("--instances", type=int, metavar="N", help="instance budget: the most it serves")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace (%(default)s)")
    p.add_argument("--limit", type=int, default=2000, metavar="N", help="its first N requests (default 2000; 0: all)")
    p.add_argument("--max-output-tokens", type=int, metavar="N",
                   help="cap each request's output at N tokens (as bench compare's trace workload does)")  # fmt: skip
    p.add_argument("--profile", default="analytic-gpu", metavar="NAME|JSON",
                   help=f"latency profile: {', '.join(PROFILES)}, or a JSON one (e.g. recorded on a GPU)")  # fmt: skip
    p.add_argument("--ttft-slo-ms", type=float, required=True, help="TTFT SLO, ms")
    p.add_argument("--tbt-slo-ms", type=float, required=True, help="TBT SLO (mean of a request's longest 10%% gaps)")
    p.add_argument("--deployments", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS),
                   help="deployments to consider (default all)")  # fmt: skip
    p.add_argument("--disaggregation", choices=DISAGGREGATION, default="cost",
                   help="the conditional deployment's rule (default cost)")  # fmt: skip
    p.add_argument("--min-instances", type=int, default=2, metavar="N", help="--rate: start here (default 2)")
    p.add_argument("--max-instances", type=int, default=32, metavar="N", help="--rate: give up past here (default 32)")
    p.add_argument("--prediction-error", type=float, default=0.0, metavar="SIGMA",
                   help="model error: each job runs exp(N(0, SIGMA)) x its predicted time (default 0)")  # fmt: skip
    p.add_argument("--no-tune", action="store_true", help="skip the tuning walk after the split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="simulations in parallel (default 2)")
    p.add_argument("--out", type=Path, help="results folder (default a fresh one under runs/bench/)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def main(args: argparse.Namespace) -> int:
    """Search, tune, write the files; 1 when no cluster up to ``--max-instances`` meets the SLOs at ``--rate``."""
    if args.rate is not None and args.rate <= 0 or args.instances is not None and args.instances < 1:
        raise ValueError("--rate must be > 0 and --instances >= 1")
    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        raise ValueError("--max-output-tokens must be >= 1")
    if not 1 <= args.min_instances <= args.max_instances:
        raise ValueError("need 1 <= --min-instances <= --max-instances")
    limit = args.limit or None
    profile = named_profile(str(args.profile))
    requests = load_trace(args.trace, limit=limit)
    bed = Bed(args.trace, limit, args.max_output_tokens, profile, args.ttft_slo_ms / 1e3, args.tbt_slo_ms / 1e3,
              args.disaggregation, args.prediction_error, args.seed, trace_rate(requests))  # fmt: skip
    defaults = SimConfig()
    knobs = Knobs(defaults.kv_cache_balancing_threshold, profile.chunk_tokens, profile.max_running)
    out = Path(args.out or fresh_out("plan"))
    planner = Planner(bed, knobs, args.jobs, args.quiet)
    planner.say(f"{len(requests)} requests of {args.trace} ({bed.base_rate:.2f} req/s as recorded), profile "
                f"{profile.name}, SLOs TTFT {args.ttft_slo_ms:g} ms / TBT {args.tbt_slo_ms:g} ms")  # fmt: skip
    n, search = args.instances, []
    if args.rate is not None:
        search = planner.smallest(args.rate, args.deployments, args.min_instances, args.max_instances)
        if search[-1]["attainment"] < ATTAINMENT:
            print(f"no deployment of up to {args.max_instances} instances meets the SLOs at {args.rate:g} req/s",
                  file=sys.stderr)  # fmt: skip
            return 1
        n = search[-1]["instances"]
    found = candidates(n, args.deployments)
    ranked = sorted(zip(found, planner.capacities(found, knobs, args.rate or bed.base_rate), strict=True),
                    key=lambda cr: cr[1]["capacity"] or 0.0, reverse=True)  # fmt: skip
    chosen, best = ranked[0]
    capacity = best["capacity"] or 0.0
    steps: list[dict[str, Any]] = []
    if not args.no_tune:
        knobs, steps = planner.tune(chosen, capacity)
        capacity = max([capacity] + [max(s["capacity"].values()) for s in steps])
    command = command_line()
    code = git_state()
    goal = f"at {args.rate:g} req/s" if args.rate is not None else f"with {n} instances"
    header = [f"kvconductor plan: {chosen.label} ({chosen.deployment}), predicted SLO capacity {capacity:.2f} req/s",
              f"({goal}; TTFT {args.ttft_slo_ms:g} ms, TBT {args.tbt_slo_ms:g} ms, {ATTAINMENT:.0%} within them)",
              f"code {code}; `{command}`"]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.toml").write_text(config_toml(chosen, knobs, bed, header))
    write_json(out / "plan.json", {
        "kind": "plan", "code": code, "command": command, "instances": n, "rate": args.rate,
        "trace": str(args.trace), "limit": limit, "max_output_tokens": args.max_output_tokens,
        "base_rate": bed.base_rate, "profile": profile.name,
        "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "attainment": ATTAINMENT},
        "chosen": chosen.label, "deployment": chosen.deployment, "capacity": capacity,
        "knobs": asdict(knobs), "tuning": steps, "search": search,
        "candidates": {c.label: r | {"deployment": c.deployment} for c, r in ranked},
    })  # fmt: skip
    plot(out / "plan.png", ranked, chosen, args.rate)
    print(f"{header[0]}\n  {header[1]}")
    for c, r in ranked:
        print(f"  {'*' if c == chosen else ' '} {c.label:>14}  {_describe(r)}")
    print(f"config: {out / 'plan.toml'} (kvconductor up --config {out / 'plan.toml'}); plot: {out / 'plan.png'}")
    return 0
