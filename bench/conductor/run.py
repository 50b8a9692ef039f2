"""Decision latency of the Conductor's policy, in-process: hashing, kvmeta prefix match, Algorithm 1.

For each (prefill instances, prompt tokens) case, the KV index holds a random-length prefix of the prompt
on every instance (plus unrelated blocks), the decode pool has 8 instances with busy batches, and one
decision is timed in three stages: chained block hashes of the prompt, ``KVIndex.match_prefix``, and
``ConductorPolicy.schedule`` over every candidate. The gRPC hop to kvmeta is not included.

    .venv/bin/python -m bench.conductor.run [--instances 8 64 256] [--tokens 1024 8192 32768 100000] [--json FILE]

``--json`` writes the rows with the code they ran and the command (``bench/results/conductor/`` holds the
committed run).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.provenance import git_state
from engine.block_hash import prefix_block_hashes
from scheduler.candidates import DecodeCandidate, PrefillCandidate, RequestShape, Resident, Slo
from scheduler.cost_model import DecodeModel, LinkModels, PrefillModel, TransferModel
from scheduler.kv_index import KVIndex
from scheduler.policy import ConductorPolicy

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 64 * 1024
PREFILL = PrefillModel(0.002, 0.0003, 2e-8)
DECODE = DecodeModel(0.005, 0.0006, 2e-6)


def _case(instances: int, tokens: int, repeats: int, rng: random.Random) -> dict[str, float | int]:
    prompt = [rng.randrange(50_000) for _ in range(tokens)]
    hashes = prefix_block_hashes(prompt, BLOCK_SIZE)
    index = KVIndex()
    for i in range(instances):
        held = hashes[: rng.randrange(len(hashes) + 1)] + [rng.randbytes(32) for _ in range(64)]
        index.apply(f"p{i}", 1, held, [], full=True)
    decodes = [
        DecodeCandidate(f"d{j}", tuple(Resident(-1.0, 5.0, 2000) for _ in range(16)), 100_000, 256, DECODE)
        for j in range(8)
    ]
    policy = ConductorPolicy()
    links = LinkModels(TransferModel.from_gbps(100))
    shape = RequestShape(tokens, tokens // BLOCK_SIZE + 64, BLOCK_SIZE, BYTES_PER_BLOCK)
    stages: dict[str, list[float]] = {"hash": [], "match": [], "schedule": [], "total": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_hashes = prefix_block_hashes(prompt, BLOCK_SIZE)
        t1 = time.perf_counter()
        match = index.match_prefix(block_hashes)
        t2 = time.perf_counter()
        prefills = [
            PrefillCandidate(f"p{i}", match.prefix_blocks.get(f"p{i}", 0) * BLOCK_SIZE, rng.random(), PREFILL)
            for i in range(instances)
        ]
        policy.schedule(prefills, decodes, shape, Slo(1e9, 1e9), links)
        t3 = time.perf_counter()
        for name, seconds in (("hash", t1 - t0), ("match", t2 - t1), ("schedule", t3 - t2), ("total", t3 - t0)):
            stages[name].append(seconds * 1e3)
    row: dict[str, float | int] = {"instances": instances, "tokens": tokens, "repeats": repeats}
    for name, values in stages.items():
        values.sort()
        row[f"{name}_p50_ms"] = statistics.median(values)
        row[f"{name}_p99_ms"] = values[min(len(values) - 1, int(len(values) * 0.99))]
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the cases and print a table (and JSON when asked)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, nargs="+", default=[8, 64, 256], help="prefill instance counts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768, 100_000], help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=200, help="decisions timed per case (default 200)")
    parser.add_argument("--json", help="also write the rows (with the code and the command) to this JSON file")
    args = parser.parse_args(argv)
    code = git_state()  # before anything runs: the code this run measures
    rng = random.Random(0)
    rows = []
    cases = [(i, t) for i in args.instances for t in args.tokens]
    for k, (instances, tokens) in enumerate(cases, 1):
        print(f"[{k}/{len(cases)}] {instances} instances, {tokens} tokens ...", file=sys.stderr, flush=True)
        rows.append(_case(instances, tokens, args.repeats, rng))
    header = f"{'instances':>9} {'tokens':>7} | {'hash p50/p99':>14} | {'match p50/p99':>14} | "
    header += f"{'schedule p50/p99':>16} | {'total p50/p99 (ms)':>18}"
    print(header)
    for r in rows:
        cells = [f"{r[f'{s}_p50_ms']:.3f}/{r[f'{s}_p99_ms']:.3f}" for s in ("hash", "match", "schedule", "total")]
        print(
            f"{r['instances']:>9} {r['tokens']:>7} | {cells[0]:>14} | {cells[1]:>14} | {cells[2]:>16} | {cells[3]:>18}"
        )
    if args.json:
        command = "python -m bench.conductor.run " + shlex.join(argv if argv is not None else sys.argv[1:])
        record = {"kind": "conductor", "code": code, "command": command.strip(), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
