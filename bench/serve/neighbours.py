"""``python -m bench.serve.neighbours``: do hostile requests slow the streams running beside them?

    python -m bench.serve.neighbours                         # own tiny-model cluster, ~3 min on two cores
    python -m bench.serve.neighbours --rounds 5 --streams 4  # more quiet/hostile pairs, more neighbours
    python -m bench.serve.neighbours --base-url http://127.0.0.1:8000/v1 --model tiny-llama --config CONF

Issue 27's acceptance line: 100,000 stop strings and a 1 MB prompt are refused or bounded, and the TBT of
streams running beside them stays within the measured noise of a quiet run.

Steps: start a cluster (``kvconductor up``: 1 prefill + 1 decode worker, the tiny random-weight model,
64 MiB of KV each, free ports; ``--set`` adds overrides) or use ``--base-url``; warm up (twice
``--streams`` candidate streams, then each hostile kind once, which must be refused); then ``--rounds``
times a quiet phase and a hostile phase, and a last quiet phase (Q H Q H ... Q, so drift of the
machine's load shows in the quiet phases on both sides of every hostile one). Every phase runs the same
``--streams`` greedy streaming completions of ``--output-len`` tokens at once (``ignore_eos``,
token-id prompts: nothing to tokenize) and records every chunk's arrival (``bench.serve.client``).

Chunks, not tokens: a token whose text is an incomplete UTF-8 character sends no chunk (the Conductor
holds it back), so one gap can span many tokens. The random-weight model's byte outputs do that for
runs of up to hundreds of tokens (one gap of seconds), so the warm-up keeps the candidates with the most
chunks (their counts are reported), and greedy decoding gives each phase exactly the same chunks: the
phases differ in timing only. In a hostile phase a separate
process at nice 19 (so building and sending its bodies costs the measuring loop nothing, and the cores
the servers share with it only what they leave idle: an attacker's CPU is its own) sends, one after another
in a loop (``--hostile-concurrency`` loops), at ``--hostile-rate`` requests per second in all (open loop;
with 0, each loop sends its next request as soon as the last is answered: a flood whose rate is how fast
the servers refuse, which takes whatever CPU they leave idle), until the streams end:

- ``stops``: a completion with ``--stop-strings`` distinct stop strings (refused: ``max_stop_strings``);
- ``prompt-at-limit``: a text prompt of ``[scheduler] max_prompt_bytes`` bytes, or as many as fit the body
  limit (refused: more tokens than the model's context, proven from its bytes where the tokenizer allows,
  else after tokenizing on a nice-19 thread);
- ``chat-at-limit``: the same text as one chat message (rendered by the chat template, then tokenized);
- ``prompt-tokenized``: the longest text prompt whose bytes do not prove it longer than the context
  (context x the tokenizer's longest token in bytes, ``engine.tokenizer.max_token_bytes``, x 16 where
  the tokenizer claims no such bound; at most the ``prompt-at-limit`` size): the Conductor must tokenize
  it (on a nice-19 thread) before refusing it, the costliest prompt a client can send;
- ``prompt-over-limit``: a prompt of ``max_prompt_bytes + 1`` bytes (refused: 413 when the body is then
  beyond ``[gateway] max_request_bytes``, else 400 naming ``max_prompt_bytes``);
- ``body-over-limit``: a body of ``max_request_bytes + 1`` bytes sent chunked, without Content-Length
  (refused 413 as it arrives).

The limits are read from ``--config`` and ``--set`` (those of the own cluster; with ``--base-url``, say
what the server runs with), the context length from the server's ``/tokenize`` and the tokenizer from
the config's ``[model] path`` where it is on this machine. Each hostile answer is counted by kind and
status, with its latency.

Verdict. Refused: every hostile request in the measured phases got 400 or 413 (nothing accepted, no
5xx, no transport error). Within noise: the TBT statistic is the p99 of every token gap of a phase's
streams pooled (a blocked event loop shows as long gaps); quiet noise = max - min of the quiet phases'
p99s (the spread of repeated quiet runs on this machine, at this moment); each hostile phase's p99 must
be <= median(quiet p99s) + 3 x noise. The quiet runs bracket the hostile ones rather than all coming
first, so a machine whose background load changes widens the noise instead of failing the hostile
phase. Max gaps are reported, not judged (one gap in a phase is no distribution).

Writes ``neighbours.json`` (config, code, command, every phase's gaps and hostile answers) and
``neighbours.md`` to ``--out`` (default a fresh ``runs/bench/neighbours-<timestamp>``). Exit status:
0 PASS, 1 FAIL, 2 no run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

from bench.provenance import fresh_out, git_state
from bench.serve.client import RequestResult, error_reason
from bench.serve.metrics import jsonable, percentile
from bench.serve.runner import Target, check_target
from bench.serve.workloads import BenchRequest, random_lengths
from cli.local_cluster import REPO, TINY_MODEL, local_cluster

KINDS = ("stops", "prompt-at-limit", "chat-at-limit", "prompt-tokenized", "prompt-over-limit", "body-over-limit")
UNBOUNDED_TOKEN_BYTES = 16  # bytes per token assumed for ``prompt-tokenized`` where the tokenizer gives no bound
CLUSTER = ("prefill.node_count=1", "decode.node_count=1", "colocated.node_count=0",
           "prefill.kv_cache_memory_mb=64", "decode.kv_cache_memory_mb=64")  # fmt: skip
REFUSED = (400, 413)
HOSTILE_TIMEOUT_S = 120.0


def parser() -> argparse.ArgumentParser:
    """Every flag, with its help."""
    p = argparse.ArgumentParser(
        prog="python -m bench.serve.neighbours",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    n = p.add_argument_group("neighbour streams")
    n.add_argument("--streams", type=int, default=3, help="streams at once in every phase (default 3)")
    n.add_argument("--output-len", type=int, default=200, help="tokens per stream, ignore_eos (default 200)")
    n.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per stream (default 64)")
    n.add_argument("--rounds", type=int, default=3,
                   help="quiet+hostile pairs before the last quiet phase (default 3: Q H Q H Q H Q)")  # fmt: skip
    n.add_argument("--seed", type=int, default=0, help="seeds the prompts (default 0)")
    h = p.add_argument_group("hostile requests")
    h.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, cycled in order (default {','.join(KINDS)})"
    )
    h.add_argument("--stop-strings", type=int, default=100_000, help="stop strings of 'stops' (default 100000)")
    h.add_argument("--hostile-concurrency", type=int, default=1,
                   help="hostile loops at once, each one request at a time (default 1)")  # fmt: skip
    h.add_argument("--hostile-rate", type=float, default=8.0,
                   help="hostile requests per second, all loops together, open loop (default 8; 0: each loop "
                   "sends its next as soon as its last is answered, a flood as fast as the refusals)")  # fmt: skip
    c = p.add_argument_group("cluster")
    c.add_argument("--base-url", help="a running server's OpenAI base URL ending in /v1 (default: start a cluster)")
    c.add_argument("--model", default="tiny-llama", help="the model field of every request (default tiny-llama)")
    c.add_argument("--api-key", help="bearer key, if the server wants one")
    c.add_argument("--config", default=str(REPO / "deploy/config.toml"),
                   help="the cluster's config: the own cluster's, and where the limits are read (default "
                   "deploy/config.toml)")  # fmt: skip
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override (repeatable; the own cluster gets it after the defaults: the tiny model, "
                   "1 prefill + 1 decode worker, 64 MiB KV each, free ports)")  # fmt: skip
    r = p.add_argument_group("report")
    r.add_argument("--out", help="directory for neighbours.json/.md (default a fresh folder under runs/bench/)")
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


class Log:
    """Progress lines on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.t0 = quiet, time.monotonic()

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[neighbours {time.monotonic() - self.t0:6.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Limits:
    """The bounds the hostile requests are sized against."""

    max_prompt_bytes: int
    max_request_bytes: int
    max_stop_strings: int
    tokenized_bytes: int  # the longest text prompt that is tokenized before it is refused


# -- the hostile sender (a separate process) -----------------------------------------------------------------


def _text(n: int, seed: int) -> str:
    """``n`` bytes of lowercase words (ASCII: bytes = characters)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) + " " for _ in range(512)]
    text = ""
    while len(text) < n:
        text += "".join(rng.choices(words, k=(n - len(text)) // 4 + 1))
    return text[:n]


def _stop_strings(n: int) -> list[str]:
    """``n`` distinct short stop strings (base 36)."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"

    def b36(i: int) -> str:
        s = ""
        while True:
            i, d = divmod(i, 36)
            s = digits[d] + s
            if i == 0:
                return s

    return [b36(i) for i in range(n)]


def _dump(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _fill(template: dict[str, Any], field: str, target_bytes: int, seed: int, nest: str | None = None) -> bytes:
    """``template`` with a text ``field`` (inside ``template[nest][0]`` if given) grown so the body has
    ``target_bytes`` bytes."""

    def with_text(text: str) -> bytes:
        body = json.loads(json.dumps(template))
        (body[nest][0] if nest else body)[field] = text
        return _dump(body)

    overhead = len(with_text(""))
    return with_text(_text(max(1, target_bytes - overhead), seed))


def hostile_bodies(kinds: list[str], model: str, limits: Limits, stop_strings: int) -> dict[str, tuple[str, bytes]]:
    """(path, body) of each kind."""
    base = {"model": model, "max_tokens": 1, "temperature": 0.0}
    at_limit = min(limits.max_prompt_bytes, limits.max_request_bytes - 200)  # the rest of the body fits beside it
    out: dict[str, tuple[str, bytes]] = {}
    for kind in kinds:
        if kind == "stops":
            out[kind] = ("/completions", _dump(base | {"prompt": "hello", "stop": _stop_strings(stop_strings)}))
        elif kind == "prompt-at-limit":
            out[kind] = ("/completions", _dump(base | {"prompt": _text(at_limit, 1)}))
        elif kind == "chat-at-limit":
            body = base | {"messages": [{"role": "user", "content": _text(at_limit, 2)}]}
            out[kind] = ("/chat/completions", _dump(body))
        elif kind == "prompt-tokenized":
            out[kind] = ("/completions", _dump(base | {"prompt": _text(min(at_limit, limits.tokenized_bytes), 5)}))
        elif kind == "prompt-over-limit":
            out[kind] = ("/completions", _dump(base | {"prompt": _text(limits.max_prompt_bytes + 1, 3)}))
        elif kind == "body-over-limit":
            out[kind] = ("/completions", _fill(base | {"prompt": ""}, "prompt", limits.max_request_bytes + 1, 4))
        else:
            raise ValueError(f"unknown hostile kind {kind!r}; known: {', '.join(KINDS)}")
    return out


def _chunks(body: bytes, size: int = 64 << 10) -> Iterator[bytes]:
    for i in range(0, len(body), size):
        yield body[i : i + size]


def send_hostile(client: httpx.Client, kind: str, path: str, body: bytes) -> dict[str, Any]:
    """One hostile request; its kind, start (perf_counter, the same clock in every process), latency, status."""
    headers = {"content-type": "application/json"}
    t0 = time.perf_counter()
    try:
        if kind == "body-over-limit":  # chunked: no Content-Length to refuse it by
            response = client.post(path, content=_chunks(body), headers=headers)
        else:
            response = client.post(path, content=body, headers=headers)
        status, reason = response.status_code, error_reason(response.status_code, response.text)
    except httpx.HTTPError as e:
        status, reason = 0, f"transport: {type(e).__name__}"
    return {"kind": kind, "t0": t0, "latency_s": time.perf_counter() - t0, "status": status, "reason": reason}


def hostile_loop(
    base_url: str, headers: dict[str, str], bodies: dict[str, tuple[str, bytes]], offset: int, interval_s: float,
    stop: Event, ready: Event, pipe: Connection,
) -> None:  # fmt: skip
    """Send the kinds in turn (starting at ``offset``), one each ``interval_s`` (0: back to back), until ``stop``;
    the answers go back through ``pipe``.

    At nice 19: an attacker's own CPU is on its machine, not on the servers' cores (here they share two).
    """
    os.nice(19)
    kinds = list(bodies)
    answers = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=HOSTILE_TIMEOUT_S) as client:
        ready.set()
        start = time.perf_counter()
        sent = 0
        while not stop.is_set():
            kind = kinds[(offset + sent) % len(kinds)]
            answers.append(send_hostile(client, kind, *bodies[kind]))
            sent += 1
            stop.wait(max(0.0, start + sent * interval_s - time.perf_counter()))  # late: at once, no catch-up burst
    pipe.send(answers)
    pipe.close()


@contextmanager
def hostile(
    target: Target, bodies: dict[str, tuple[str, bytes]], loops: int, rate: float
) -> Iterator[list[dict[str, Any]]]:
    """``loops`` sender processes, ``rate`` requests/s together (0: back to back), running for the body of the
    ``with``; the answers fill the yielded list."""
    interval_s = loops / rate if rate > 0 else 0.0
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    procs, pipes, readies = [], [], []
    for i in range(loops):
        ready = ctx.Event()
        receiver, sender = ctx.Pipe(duplex=False)
        args = (target.base_url, headers, bodies, i, interval_s, stop, ready, sender)
        proc = ctx.Process(target=hostile_loop, args=args, name=f"hostile-{i}", daemon=True)
        proc.start()
        sender.close()
        procs.append(proc)
        pipes.append(receiver)
        readies.append(ready)
    answers: list[dict[str, Any]] = []
    try:
        for ready in readies:
            if not ready.wait(60):
                raise RuntimeError("a hostile sender did not start within 60 s")
        time.sleep(0.2)  # its first request is on the way
        yield answers
    finally:
        stop.set()
        for proc, pipe in zip(procs, pipes, strict=True):
            if pipe.poll(HOSTILE_TIMEOUT_S + 10):
                answers.extend(pipe.recv())
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


# -- the neighbours ----------------------------------------------------------------------------------------


async def streams(target: Target, requests: list[BenchRequest]) -> list[RequestResult]:
    """The requests at once, streamed and timed chunk by chunk."""
    from bench.serve.client import send

    async with target.client(len(requests)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, r, target.model, "completions", start) for r in requests))
    for r in results:
        r.start_s += start  # absolute perf_counter, to line gaps up with the hostile requests
    return list(results)


def gap_stats(results: list[RequestResult]) -> dict[str, Any]:
    """Pooled inter-chunk gaps of the completed streams, in ms."""
    gaps = [g * 1e3 for r in results if r.error is None for g in r.itl]
    return {
        "gaps": len(gaps),
        "p50": percentile(gaps, 50),
        "p90": percentile(gaps, 90),
        "p99": percentile(gaps, 99),
        "max": max(gaps) if gaps else float("nan"),
        "ttft_ms": [r.ttft * 1e3 if r.ttft is not None else None for r in results],
        "tbt_ms": [r.tbt * 1e3 if r.tbt is not None else None for r in results],  # the paper's, per stream
        "errors": [r.error for r in results if r.error is not None],
    }


def longest_gaps(results: list[RequestResult], answers: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """The ``n`` longest gaps, each with the hostile requests in flight during it."""
    gaps = []
    for s, r in enumerate(results):
        if r.ttft is None:
            continue
        t = r.start_s + r.ttft
        for g in r.itl:
            gaps.append((g, s, t, t + g))
            t += g
    gaps.sort(reverse=True)
    out = []
    for g, s, lo, hi in gaps[:n]:
        during = sorted({a["kind"] for a in answers if a["t0"] < hi and a["t0"] + a["latency_s"] > lo})
        out.append({"gap_ms": g * 1e3, "stream": s, "hostile_in_flight": during})
    return out


def hostile_stats(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: answers by status, latency p50/max in ms, the reasons."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(a["kind"] for a in answers):
        mine = [a for a in answers if a["kind"] == kind]
        latencies = [a["latency_s"] * 1e3 for a in mine]
        out[kind] = {
            "sent": len(mine),
            "statuses": dict(Counter(str(a["status"]) for a in mine)),
            "latency_p50_ms": percentile(latencies, 50),
            "latency_max_ms": max(latencies),
            "reasons": dict(Counter(a["reason"] for a in mine)),
        }
    return out


def phase(target: Target, name: str, requests: list[BenchRequest], bodies: dict[str, tuple[str, bytes]] | None,
          loops: int, rate: float, log: Log) -> dict[str, Any]:  # fmt: skip
    """One quiet (``bodies`` None) or hostile phase."""
    answers: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if bodies is None:
        results = asyncio.run(streams(target, requests))
    else:
        with hostile(target, bodies, loops, rate) as answers:
            results = asyncio.run(streams(target, requests))
    wall = time.perf_counter() - t0
    record: dict[str, Any] = {"phase": name, "wall_s": wall, "stats": gap_stats(results)}
    record["longest"] = longest_gaps(results, answers)
    record |= {"hostile": hostile_stats(answers), "answers": answers} if bodies is not None else {}
    record["itl_ms"] = [[g * 1e3 for g in r.itl] for r in results]
    s = record["stats"]
    line = f"{name}: {s['gaps']} gaps, p50 {s['p50']:.1f} p90 {s['p90']:.1f} p99 {s['p99']:.1f} max {s['max']:.1f} ms"
    if bodies is not None:
        line += f"; {len(answers)} hostile ({len(answers) / wall:.1f}/s): " + ", ".join(
            f"{k} {'/'.join(f'{n}x{st}' for st, n in v['statuses'].items())}" for k, v in record["hostile"].items()
        )
    log(line + (f"; stream errors {s['errors']}" if s["errors"] else ""))
    return record


def verdict(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Refused (every measured hostile answer 400/413) and within noise (module docstring)."""
    quiet = [p["stats"]["p99"] for p in phases if p["phase"].startswith("quiet")]
    hostile_ = [p for p in phases if p["phase"].startswith("hostile")]
    reference, noise = statistics.median(quiet), max(quiet) - min(quiet)
    bound = reference + 3 * noise
    worst = max(p["stats"]["p99"] for p in hostile_)
    answers = [a for p in hostile_ for a in p["answers"]]
    bad = Counter(f"{a['kind']} {a['status']}" for a in answers if a["status"] not in REFUSED)
    stream_errors = [e for p in phases for e in p["stats"]["errors"]]
    refused = not bad and bool(answers)
    within = worst <= bound
    passed = refused and within and not stream_errors
    parts = [
        f"hostile p99 TBT {worst:.1f} ms {'<=' if within else '>'} bound {bound:.1f} ms "
        f"(median quiet p99 {reference:.1f} + 3 x quiet spread {noise:.1f})",
        f"{len(answers)} hostile requests, " + ("all refused 400/413" if refused else f"not refused: {dict(bad)}"),
    ]
    if stream_errors:
        parts.append(f"{len(stream_errors)} neighbour streams failed")
    return {
        "passed": passed,
        "refused": refused,
        "within_noise": within,
        "quiet_p99_ms": quiet,
        "reference_ms": reference,
        "noise_ms": noise,
        "bound_ms": bound,
        "hostile_p99_ms": [p["stats"]["p99"] for p in hostile_],
        "line": ("PASS: " if passed else "FAIL: ") + "; ".join(parts),
    }


def _rate(rate: float) -> str:
    return f"{rate:g} requests/s offered, open loop" if rate > 0 else "back to back (a flood)"


def markdown(record: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [
        "# Neighbours of hostile requests: TBT, quiet vs hostile",
        "",
        f"- code: `{record['code']}`",
        f"- command: `{record['command']}`",
        f"- finished: {record['finished_at']}, {record['wall_s']:.0f} s; cluster: {record['cluster']}",
        f"- limits: {record['limits']}",
        f"- {record['config']['streams']} streams x {record['config']['output_len']} tokens per phase; hostile "
        f"loops: {record['config']['hostile_concurrency']}, {_rate(record['config'].get('hostile_rate', 0))}; "
        f"chunks per candidate stream in the warm-up (the most "
        f"chunked {record['config']['streams']} run in every phase): {record['warmup_chunks']}",
        "",
        "Token gaps of the neighbour streams, pooled per phase (ms):",
        "",
        "| phase | gaps | p50 | p90 | p99 | max | hostile answers |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for p in record["phases"]:
        s = p["stats"]
        hostile_ = ", ".join(f"{k} {v['sent']}" for k, v in p.get("hostile", {}).items()) or "-"
        if "hostile" in p:
            hostile_ = f"{len(p['answers']) / p['wall_s']:.1f}/s: {hostile_}"
        lines.append(f"| {p['phase']} | {s['gaps']} | {s['p50']:.1f} | {s['p90']:.1f} | {s['p99']:.1f} | "
                     f"{s['max']:.1f} | {hostile_} |")  # fmt: skip
    lines += ["", "Hostile requests, all measured phases:", "",
              "| kind | sent | statuses | latency p50 ms | latency max ms | reason |",
              "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for kind, v in record["hostile"].items():
        statuses = ", ".join(f"{n} x {s}" for s, n in v["statuses"].items())
        reason = "; ".join(v["reasons"])[:160].replace("|", "/")
        lines.append(f"| {kind} | {v['sent']} | {statuses} | {v['latency_p50_ms']:.0f} | {v['latency_max_ms']:.0f} | "
                     f"{reason} |")  # fmt: skip
    lines += ["", "Longest gaps of each hostile phase, with the hostile kinds in flight:", ""]
    for p in record["phases"]:
        if p["phase"].startswith("hostile"):
            gaps = "; ".join(f"{g['gap_ms']:.0f} ms ({', '.join(g['hostile_in_flight']) or 'none'})"
                             for g in p["longest"])  # fmt: skip
            lines.append(f"- {p['phase']}: {gaps}")
    lines += ["", f"**{record['verdict']['line']}**", ""]
    return "\n".join(lines)


@dataclass
class Running:
    target: Target
    description: str


@contextmanager
def cluster(args: argparse.Namespace, log: Log) -> Iterator[Running]:
    """The given server, or a new cluster stopped on the way out."""
    if args.base_url:
        yield Running(Target(args.base_url.rstrip("/"), args.model, args.api_key), f"given ({args.base_url})")
        return
    run_dir = REPO / "runs" / time.strftime("neighbours-%Y%m%d-%H%M%S") / "cluster"
    overrides = (*TINY_MODEL, *CLUSTER, *args.set)
    log(f"starting a cluster (kvconductor up; logs in {run_dir})")
    with local_cluster(args.config, overrides, run_dir) as running:
        log(f"cluster up in {running.startup_s:.1f} s at {running.rest}")
        description = "own: tiny-llama, 1 prefill + 1 decode, 64 MiB KV each" + "".join(f", {s}" for s in args.set)
        yield Running(Target(running.rest.rstrip("/"), args.model, args.api_key), description)
        log("stopping the cluster")


def limits_of(args: argparse.Namespace, target: Target) -> Limits:
    """The bounds of the config the cluster runs with; the context length as the server reports it."""
    from engine.tokenizer import load_tokenizer, max_token_bytes
    from services.common.config import load_config

    config = load_config(args.config, (*TINY_MODEL, *args.set) if not args.base_url else args.set)
    s, g = config.scheduler, config.gateway
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    root = target.base_url.removesuffix("/v1")  # /tokenize sits beside /v1, as on vLLM's server
    answer = httpx.post(f"{root}/tokenize", json={"prompt": "x"}, headers=headers, timeout=60)
    answer.raise_for_status()
    per_token = None
    if (Path(config.model.path) / "tokenizer.json").is_file():
        per_token = max_token_bytes(load_tokenizer(config.model.path))
    # the bound refuses more than max_model_len - 1 tokens' worth of bytes (a prompt leaves room for one token)
    tokenized = (answer.json()["max_model_len"] - 1) * (per_token or UNBOUNDED_TOKEN_BYTES)
    return Limits(s.max_prompt_bytes, g.max_request_bytes, s.max_stop_strings, tokenized)


def run(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """Warm up, then the phases; the JSON record."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    t0 = time.monotonic()
    with cluster(args, log) as running:
        target = running.target
        asyncio.run(check_target(target))
        limits = limits_of(args, target)
        log(f"limits: {limits}; building the hostile bodies")
        bodies = hostile_bodies(kinds, args.model, limits, args.stop_strings)
        log("bodies: " + ", ".join(f"{k} {len(b) / 1024:.0f} KiB" for k, (_, b) in bodies.items()))
        n, m = args.streams, args.output_len
        candidates = random_lengths(2 * n, (args.prompt_len, args.prompt_len), (m, m), args.seed)
        log(f"warm-up: {2 * n} candidate streams (the {n} with the most chunks run in every phase), then each "
            "hostile kind once")  # fmt: skip
        warm = phase(target, "warm-up", candidates, None, 1, 0.0, log)
        chunks = [len(itl) + 1 for itl in warm["itl_ms"]]
        best = sorted(range(len(candidates)), key=lambda i: -chunks[i])[:n]
        requests = [candidates[i] for i in sorted(best)]
        log(f"chunks per {m}-token stream: {chunks}; chosen: {[chunks[i] for i in sorted(best)]}")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        with httpx.Client(base_url=target.base_url, timeout=HOSTILE_TIMEOUT_S, headers=headers) as client:
            for kind, (path, body) in bodies.items():
                a = send_hostile(client, kind, path, body)
                log(f"  {kind}: {a['status']} in {a['latency_s'] * 1e3:.0f} ms: {a['reason'][:150]}")
        phases = []
        for i in range(args.rounds + 1):
            phases.append(phase(target, f"quiet {i + 1}", requests, None, 1, 0.0, log))
            if i < args.rounds:
                loops, rate = args.hostile_concurrency, args.hostile_rate
                phases.append(phase(target, f"hostile {i + 1}", requests, bodies, loops, rate, log))
        description = running.description
    answers = [a for p in phases for a in p.get("answers", [])]
    return {
        "kind": "neighbours",
        "code": git_state(),
        "command": "python -m bench.serve.neighbours " + shlex.join(sys.argv[1:]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.monotonic() - t0,
        "config": {k: v for k, v in vars(args).items() if k not in ("quiet", "api_key")},
        "cluster": description,
        "limits": vars(limits),
        "bodies_bytes": {k: len(b) for k, (_, b) in bodies.items()},
        "warmup_chunks": chunks,
        "phases": phases,
        "hostile": hostile_stats(answers),
        "verdict": verdict(phases),
    }


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """Run; 0 PASS, 1 FAIL, 2 when it could not run."""
    args = parser().parse_args(argv)
    log = Log(args.quiet)
    if min(args.streams, args.output_len, args.prompt_len, args.rounds, args.hostile_concurrency) < 1:
        print("error: --streams, --output-len, --prompt-len, --rounds, --hostile-concurrency must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.hostile_rate < 0:
        print("error: --hostile-rate must be >= 0 (0: back to back)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)  # so the own cluster is stopped on SIGTERM too
    try:
        record = run(args, log)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no report written (the cluster this run started is stopped)", file=sys.stderr)
        return 130
    out = Path(args.out or fresh_out("neighbours"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "neighbours.json").write_text(json.dumps(jsonable(record), indent=1) + "\n")
    (out / "neighbours.md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {out}/neighbours.json, neighbours.md")
    return 0 if record["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
