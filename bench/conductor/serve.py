"""The Conductor's own cost, end to end: one Conductor process on one core, stub workers that answer at once.

Real processes on loopback: an embedded etcd, kvmeta, one Conductor pinned to core 0, and a fleet of N stub
colocated workers (``bench.conductor.fleet``) with the client on the other core. Each stub holds a random-length
prefix of every base prompt in kvmeta, so the Conductor's prefix match (on its replica of kvmeta's index) and
Algorithm 1 work on real candidates; what a request costs beyond that is the stubs' gRPC answers, which take no
time of their own.

Per (instances, prompt tokens) case, ``--requests`` requests one at a time over the Conductor's gRPC API
(token ids: tokenizing is timed on its own, below), each a base prompt with a fresh last block:

* the client's time to the first token and to the last (p50, p99): the Conductor's added latency plus two
  loopback gRPC hops;
* the Conductor's stages from its ``kvconductor_conductor_stage_seconds`` histogram (mean ms per request:
  hash, match = on the Conductor's replica of kvmeta's index, decide = Algorithm 1, book);

then, at ``--rate-tokens`` and each instance count, a closed loop of ``--concurrency`` clients for
``--seconds``: requests/s and streamed tokens/s the one-core Conductor sustains, its CPU utilisation and CPU
time per request (/proc; background work such as load polling included).
Tokenization: the model's tokenizer on text of each prompt length, in this process.

    .venv/bin/python -m bench.conductor.serve [--instances 16 64 256] [--tokens 1024 8192 32768 100000] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from bench.provenance import REPO, fresh_out, git_state
from cli.etcd_server import EmbeddedEtcd
from cli.local_cluster import TINY_MODEL
from engine.checkpoint import make_model
from engine.tokenizer import load_tokenizer
from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from services.common.config import load_config
from services.common.net import free_port

CONDUCTOR_CORE, OTHERS_CORE = 0, 1
STAGES = ("hash", "match", "decide", "book")


def overrides(etcd: EmbeddedEtcd, cluster: str) -> list[str]:
    """The cluster's config: the tiny model's tokenizer, SLOs that admit everything, the embedded etcd."""
    return [*TINY_MODEL, f'cluster.etcd_endpoints=["{etcd.endpoint}"]', f'cluster.name="{cluster}"',
            f'cluster.scheduler_endpoint="127.0.0.1:{free_port()}"', "colocated.max_ttft_ms=3600000",
            "colocated.max_tbt_ms=3600000", 'engine.backend="emulated"']  # fmt: skip


def spawn(args: list[str], core: int, log: Path) -> subprocess.Popen[bytes]:
    """A process of this benchmark on ``core`` (every thread it starts inherits the affinity).

    ``taskset`` pins it, not a ``preexec_fn``: that makes Python fork instead of vfork, and a fork while this
    process's gRPC threads run can abort the child (gRPC skips its fork handlers then; seen under load).
    """
    with log.open("ab") as out:
        return subprocess.Popen(["taskset", "-c", str(core), sys.executable, *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


@contextmanager
def processes(*started: subprocess.Popen[bytes]) -> Iterator[None]:
    """Terminate (then kill) ``started`` when the block ends."""
    try:
        yield
    finally:
        for p in started:
            p.terminate()
        for p in started:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, its threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stage_sums(metrics_url: str) -> dict[str, tuple[float, float]]:
    """stage -> (seconds, count) of the Conductor's stage histogram."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    sums: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("kvconductor_conductor_stage_seconds_sum") or line.startswith(
            "kvconductor_conductor_stage_seconds_count"
        ):
            name, _, value = line.rpartition(" ")
            stage = name.split('stage="')[1].split('"')[0]
            sums.setdefault(stage, [0.0, 0.0])[0 if "_sum" in name else 1] = float(value)
    return {stage: (s, c) for stage, (s, c) in sums.items()}


def request(base: list[int], rng: random.Random, max_tokens: int) -> conductor_pb2.GenerateRequest:
    """The base prompt with a fresh last block: its prefix is cached somewhere, the tail never."""
    ids = base[:-16] + [rng.randrange(1, 200) for _ in range(16)]
    return conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=ids), deployment=conductor_pb2.DEPLOYMENT_COLOCATED,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )  # fmt: skip


async def one(stub: Any, message: conductor_pb2.GenerateRequest) -> tuple[float, float, int]:
    """(time to first token, time to last, tokens) of one request."""
    start = time.perf_counter()
    first, tokens = 0.0, 0
    async for response in stub.Generate(message):
        n = len(response.token_ids)
        if n and not tokens:
            first = time.perf_counter() - start
        tokens += n
    return first, time.perf_counter() - start, tokens


def _ms(values: list[float], q: float) -> float:
    return round(1e3 * statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 3)


async def latency_case(
    stub: Any, conductor: dict[str, Any], base: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Requests one at a time: client latencies and the Conductor's stages."""
    rng = random.Random(len(base))
    messages = [request(base, rng, args.max_tokens) for _ in range(args.requests + args.warmup)]
    for m in messages[: args.warmup]:
        await one(stub, m)
    before = stage_sums(conductor["metrics"])
    times = [await one(stub, m) for m in messages[args.warmup :]]
    after = stage_sums(conductor["metrics"])
    stages = {s: round(1e3 * (after[s][0] - before[s][0]) / max(1.0, after[s][1] - before[s][1]), 3) for s in STAGES}
    first = [t[0] for t in times]
    return {"ttft_ms": {"p50": _ms(first, 50), "p99": _ms(first, 99)},
            "e2e_ms": {"p50": _ms([t[1] for t in times], 50)}, "stages_mean_ms": stages,
            "after_tokenization_mean_ms": round(sum(stages.values()), 3)}  # fmt: skip


async def rate_case(stub: Any, conductor: dict[str, Any], base: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """A closed loop of ``--concurrency`` clients for ``--seconds``: what one Conductor sustains."""
    rng = random.Random(7)
    messages = [request(base, rng, args.max_tokens) for _ in range(256)]
    done = {"requests": 0, "tokens": 0, "errors": 0}
    deadline = time.perf_counter() + args.seconds

    async def client(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            try:
                tokens = (await one(stub, messages[i % len(messages)]))[2]  # awaited before `+=` reads the sum
                done["tokens"] += tokens
                done["requests"] += 1
            except grpc.aio.AioRpcError:
                done["errors"] += 1
            i += args.concurrency

    cpu0, start = cpu_seconds(conductor["pid"]), time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(args.concurrency)))
    wall, cpu = time.perf_counter() - start, cpu_seconds(conductor["pid"]) - cpu0
    return {"requests_per_s": round(done["requests"] / wall, 1), "tokens_per_s": round(done["tokens"] / wall, 1),
            "requests": done["requests"], "tokens": done["tokens"], "max_tokens": args.max_tokens,
            "errors": done["errors"], "conductor_cpu_utilisation": round(cpu / wall, 3),
            "conductor_cpu_ms_per_request": round(1e3 * cpu / max(1, done["requests"]), 3),
            "concurrency": args.concurrency, "seconds": round(wall, 1)}  # fmt: skip


async def wait_for_instances(stub: Any, n: int, fleet: subprocess.Popen[bytes], log: Path,
                             timeout_s: float = 120.0) -> None:  # fmt: skip
    """Until the Conductor sees ``n`` colocated instances; an error at once if the fleet exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fleet.poll() is not None:
            raise RuntimeError(f"the stub fleet exited ({fleet.returncode}) before registering: see {log}")
        try:
            status = await stub.GetStatus(conductor_pb2.GetStatusRequest(), timeout=5)
            if sum(i.role == "colocated" for i in status.instances) >= n:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the Conductor did not see {n} instances in {timeout_s:.0f} s")


async def measure(args: argparse.Namespace, config_args: list[str], conductor: dict[str, Any],
                  bases: dict[int, list[int]], out: Path, work: Path) -> list[dict[str, Any]]:  # fmt: skip
    """Every case: a fleet per instance count, every prompt length over it (logs in ``out``)."""
    rows = []
    prompts = work / "prompts.json"  # large, and no result: beside etcd's data, not the outputs
    prompts.write_text(json.dumps(list(bases.values())))
    async with grpc.aio.insecure_channel(conductor["address"]) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        for n in args.instances:
            print(f"[conductor-cost] {n} stub instances: registering ...", flush=True)
            log = out / f"fleet-{n}.log"
            fleet = spawn(["-m", "bench.conductor.fleet", *config_args, "--instances", str(n), "--prompts",
                           str(prompts)], OTHERS_CORE, log)  # fmt: skip
            with processes(fleet):
                await wait_for_instances(stub, n, fleet, log)
                await asyncio.sleep(2.0)  # the blocks' events reach kvmeta
                for tokens, base in bases.items():
                    row = {"instances": n, "prompt_tokens": tokens, **await latency_case(stub, conductor, base, args)}
                    print(f"[conductor-cost] {n} instances, {tokens:,} tokens: {row}", flush=True)
                    rows.append(row)
                if args.rate_tokens in bases:
                    rate = await rate_case(stub, conductor, bases[args.rate_tokens], args)
                    rows.append({"instances": n, "prompt_tokens": args.rate_tokens, "sustained": rate})
                    print(f"[conductor-cost] {n} instances, sustained: {rate}", flush=True)
    return rows


def tokenization(model: str, lengths: list[int]) -> dict[int, float]:
    """Tokenizing a text of each length (in tokens) with the model's tokenizer, in this process: ms."""
    tokenizer = load_tokenizer(model)
    words = ["the", "conductor", "schedules", "prefill", "and", "decode", "by", "cost"]
    times = {}
    for n in lengths:
        text = " ".join(words[i % len(words)] for i in range(n))
        while len(tokenizer.encode(text)) > n:
            text = text[: len(text) * 9 // 10]
        start = time.perf_counter()
        tokenizer.encode(text)
        times[n] = round(1e3 * (time.perf_counter() - start), 3)
    return times


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(record: dict[str, Any]) -> str:
    """The rows as tables."""
    latency, sustained = [], []
    for r in record["rows"]:
        if "sustained" in r:
            s = r["sustained"]
            sustained.append([str(r["instances"]), f"{r['prompt_tokens']:,}", f"{s['requests_per_s']:.1f}",
                              f"{s['tokens_per_s']:.0f}", f"{s['conductor_cpu_utilisation']:.0%}",
                              f"{s['conductor_cpu_ms_per_request']:.2f}", str(s["errors"])])  # fmt: skip
            continue
        st = r["stages_mean_ms"]
        latency.append([str(r["instances"]), f"{r['prompt_tokens']:,}", *(f"{st[k]:.2f}" for k in STAGES),
                        f"{r['after_tokenization_mean_ms']:.2f}", f"{r['ttft_ms']['p50']:.2f}",
                        f"{r['ttft_ms']['p99']:.2f}"])  # fmt: skip
    lines = [f"`{record['command']}` at {record['code']}", ""]
    lines += _table(["instances", "prompt tokens", *(f"{k} ms" for k in STAGES), "after tokenization ms",
                     "client TTFT p50 ms", "TTFT p99 ms"], latency)  # fmt: skip
    lines += [
        "",
        *_table(
            ["instances", "prompt tokens", "requests/s", "tokens/s", "Conductor CPU", "CPU ms/request", "errors"],
            sustained,
        ),
    ]
    tokenize = [[f"{int(n):,}", f"{ms:.2f}"] for n, ms in record["tokenize_ms"].items()]
    lines += ["", *_table(["prompt tokens", "tokenize ms"], tokenize)]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run every case and write conductor-cost.json and .md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768, 100_000])
    parser.add_argument("--requests", type=int, default=50, help="timed requests per case, one at a time")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--rate-tokens", type=int, default=8192, help="prompt length of the sustained-rate run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", help="output folder (default: a fresh runs/bench/conductor-cost-<time>)")
    args = parser.parse_args()
    out = Path(args.out or fresh_out("conductor-cost"))
    out.mkdir(parents=True, exist_ok=True)
    code = git_state()
    os.sched_setaffinity(0, {OTHERS_CORE})
    with tempfile.TemporaryDirectory(prefix="conductor-cost-") as tmp, EmbeddedEtcd(run_dir=tmp) as etcd:
        sets = overrides(etcd, f"cost{os.getpid()}")
        config = load_config(None, sets)
        if not (REPO / config.model.path / "config.json").exists():
            make_model(REPO / config.model.path)
        config_args = [a for s in sets for a in ("--set", s)]
        kvmeta = spawn(["-m", "cli.main", "serve", "kvmeta", "--id", "kvmeta-0", *config_args], OTHERS_CORE,
                       out / "kvmeta.log")  # fmt: skip
        conductor = spawn(["-m", "cli.main", "serve", "conductor", "--id", "conductor-0", *config_args],
                          CONDUCTOR_CORE, out / "conductor.log")  # fmt: skip
        print(f"[conductor-cost] Conductor pid {conductor.pid} on core {CONDUCTOR_CORE}, logs in {out}", flush=True)
        with processes(conductor, kvmeta):
            rng = random.Random(0)
            bases = {n: [rng.randrange(1, 200) for _ in range(n)] for n in args.tokens}
            metrics_port = _metrics_port(config.cluster.etcd_endpoints[0], config.cluster.name)
            where = {"pid": conductor.pid, "address": config.cluster.scheduler_endpoint,
                     "metrics": f"http://{metrics_port}/metrics"}  # fmt: skip
            rows = asyncio.run(measure(args, config_args, where, bases, out, Path(tmp)))
    record = {"code": code, "command": "python -m bench.conductor.serve " + shlex.join(sys.argv[1:]),
              "cores": {"conductor": CONDUCTOR_CORE, "etcd, kvmeta, stubs, client": OTHERS_CORE},
              "rows": rows, "tokenize_ms": tokenization(str(REPO / config.model.path), args.tokens)}  # fmt: skip
    (out / "conductor-cost.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "conductor-cost.md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {out}/conductor-cost.json and conductor-cost.md")
    return 0


def _metrics_port(etcd_endpoint: str, cluster: str, timeout_s: float = 60.0) -> str:
    """The Conductor's /metrics host:port, from its etcd record once it registered."""
    from services.common.registry import Registry

    deadline = time.monotonic() + timeout_s
    with Registry(etcd_endpoint, cluster) as registry:
        while time.monotonic() < deadline:
            for record in registry.list("conductor").values():
                if record.metrics_address:
                    return record.metrics_address
            time.sleep(0.2)
    raise TimeoutError("the Conductor did not register")


if __name__ == "__main__":
    sys.exit(main())
