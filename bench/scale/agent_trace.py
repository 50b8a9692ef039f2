"""A tool-agent-like workload in the Mooncake trace format: long shared system prompts, many short turns.

    python -m bench.scale.agent_trace --out runs/agent_trace.jsonl
    kvconductor bench compare --engine emulated --routers --workload trace --trace runs/agent_trace.jsonl ...

Agents (``--agents``) each have a system prompt with tool schemas of 4-16k tokens. A session picks an agent
(the popular ones more often: Zipf) and runs 2-6 turns; each turn's prompt is the system prompt, the
session's history so far (every earlier turn's answer and tool result, 1-6k tokens each) and a short new
message, so most of a prompt is a prefix that an earlier request already computed: about 80% of the
prompt tokens are reusable. Sessions start as a Poisson process; a session's next turn follows its previous one after a
think time (the tool runs), so turns of many sessions interleave. Outputs are short (tool calls). Lengths
are in trace tokens (512-token blocks, ``hash_ids`` numbering them: equal ids, equal tokens), so ``bench
serve --workload trace --length-scale 1`` replays it at full length, and ``--request-rate R`` rescales its
arrivals to a mean of R requests/s as it does the Mooncake trace's. Seeded: the same flags give the same
file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
from typing import Any

BLOCK = 512  # tokens per hash id, as in Mooncake's traces


def sessions(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The trace's records in arrival order."""
    rng = random.Random(args.seed)
    ids = itertools.count()
    agents = [[next(ids) for _ in range(rng.randint(8, 32))] for _ in range(args.agents)]  # 4-16k tokens
    weights = [1 / (rank + 1) for rank in range(args.agents)]
    records: list[dict[str, Any]] = []
    start = 0.0
    while len(records) < args.requests:
        start += rng.expovariate(args.session_rate)
        history = list(rng.choices(agents, weights)[0])
        at = start
        for _ in range(rng.randint(2, 6)):
            message = [next(ids) for _ in range(rng.randint(1, 4))]  # the new text: 0.5-2k tokens
            tokens = (len(history) + len(message) - 1) * BLOCK + rng.randint(64, BLOCK)
            output = rng.randint(16, 256)
            records.append({"timestamp": round(at * 1000), "input_length": tokens, "output_length": output,
                            "hash_ids": history + message})  # fmt: skip
            history = history + message + [next(ids) for _ in range(rng.randint(2, 12))]  # answer + tool result
            at += rng.uniform(1.0, 8.0)
    records.sort(key=lambda r: int(r["timestamp"]))
    return records[: args.requests]


def main(argv: list[str] | None = None) -> int:
    """Write the trace; print what it holds."""
    p = argparse.ArgumentParser(prog="python -m bench.scale.agent_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--requests", type=int, default=400, help="records (default 400)")
    p.add_argument("--agents", type=int, default=6, help="distinct system prompts (default 6)")
    p.add_argument("--session-rate", type=float, default=1.0, help="sessions started per second (default 1)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    args = p.parse_args(argv)
    records = sessions(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen: set[int] = set()
    reusable = total = 0
    for r in records:
        blocks = r["hash_ids"]
        reusable += sum(BLOCK for h in blocks if h in seen)
        total += int(r["input_length"])
        seen.update(blocks)
    span = int(records[-1]["timestamp"]) / 1000
    print(f"wrote {args.out}: {len(records)} requests over {span:.0f} s, {total / len(records):,.0f} prompt tokens "
          f"on average, {reusable / total:.0%} of them in blocks an earlier request holds")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
