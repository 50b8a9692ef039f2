"""What the Conductor decided in a benchmark run, from the decisions its trace file recorded.

    python -m bench.scale.decisions runs/compare-<ts>/colocated --out DIR/decisions-colocated.json

A cluster that ``bench compare`` starts writes every span to ``<run>/<deployment>/traces/``; each
``conductor.schedule`` span carries the decision (``docs/observability.md``): the chosen instance's
``prefix_len``, the longest prefix any instance held (``best_len``; both count the prompts queued on an instance,
whose prefix it holds by the time the request runs there), the predicted T_queue, the decode time the
prompt shares on a colocated instance (``t_shared``) and the predicted TTFT, which the request's
``Generate`` span's measured TTFT is set against. This sums them over the run: how often the Conductor
chose an instance holding less than the longest prefix, how many prompt tokens that recomputed, what the
queue and shared-time terms it weighed were, and how its TTFT predictions compared with what happened
(actual / predicted), so that a deployment that trails can be read from its own decisions (issue 29).
Rejected requests are counted apart.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.provenance import git_state

PREFIX = "kvconductor.decision."


def summarize(trace: Path) -> dict[str, Any]:
    """The decisions of one Conductor's span file."""
    admitted: list[dict[str, Any]] = []
    rejected = 0
    ttft_ms: dict[str, float] = {}  # request id -> the TTFT its Generate span measured
    with trace.open() as f:
        for line in f:
            span = json.loads(line)
            if span.get("name", "").endswith("/Generate") and "kvconductor.ttft_ms" in span["attributes"]:
                ttft_ms[span["attributes"]["kvconductor.request_id"]] = span["attributes"]["kvconductor.ttft_ms"]
            if span.get("name") != "conductor.schedule":
                continue
            a = {k.removeprefix(PREFIX): v for k, v in span["attributes"].items() if k.startswith(PREFIX)}
            if a.get("rejected"):
                rejected += 1
            elif "prefix_len" in a:
                admitted.append(a)
    if not admitted:
        raise ValueError(f"{trace}: no admitted decisions")
    short = [a for a in admitted if a["prefix_len"] < a["best_len"]]
    ratios = sorted(ttft_ms[a["request_id"]] / a["predicted_ttft_ms"] for a in admitted
                    if ttft_ms.get(a.get("request_id", "")) and a["predicted_ttft_ms"] > 0)  # fmt: skip
    accuracy = {"ttft_actual_over_predicted_median": statistics.median(ratios),
                "ttft_actual_over_predicted_p90": ratios[int(0.9 * (len(ratios) - 1))]} if ratios else {}  # fmt: skip
    return {
        "decisions": len(admitted),
        "rejected": rejected,
        "below_best_prefix": len(short) / len(admitted),
        "reused_tokens": sum(a["prefix_len"] for a in admitted),
        "best_tokens": sum(a["best_len"] for a in admitted),
        "t_queue_ms_median": statistics.median(a["t_queue_ms"] for a in admitted),
        "t_shared_ms_median": statistics.median(a.get("t_shared_ms", 0.0) for a in admitted),
        "predicted_ttft_ms_median": statistics.median(a["predicted_ttft_ms"] for a in admitted),
        **accuracy,
    }


def main(argv: list[str] | None = None) -> int:
    """Summarize ``RUN/traces/conductor-*.jsonl``; write ``--out`` (JSON) and print it."""
    p = argparse.ArgumentParser(prog="python -m bench.scale.decisions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run", type=Path, help="one deployment's run folder (runs/compare-<ts>/<deployment>)")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    args = p.parse_args(argv)
    traces = sorted((args.run / "traces").glob("conductor-*.jsonl"))
    if not traces:
        print(f"error: no {args.run}/traces/conductor-*.jsonl (a run with [telemetry] trace_dir)", file=sys.stderr)
        return 1
    record = {"kind": "decisions", "code": git_state(),
              "command": "python -m bench.scale.decisions " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "conductors": {t.stem: summarize(t) for t in traces}}  # fmt: skip
    text = json.dumps(record, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
