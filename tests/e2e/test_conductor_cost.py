"""The Conductor's own-cost benchmark end to end, small: real etcd, kvmeta and Conductor over stub workers.

The benchmark's numbers come from the Conductor's stage histogram (``kvconductor_conductor_stage_seconds``)
and its process's CPU time: a broken histogram, a request that never reaches the stubs or a stub the
Conductor refuses shows here as a missing stage, a failed request or a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_conductor_cost_benchmark_times_every_stage_over_stub_workers(tmp_path: Path) -> None:
    out = tmp_path / "cost"
    command = [sys.executable, "-m", "bench.conductor.serve", "--instances", "3", "--tokens", "512", "2048",
               "--requests", "8", "--warmup", "2", "--rate-tokens", "2048", "--concurrency", "4", "--seconds", "2",
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "conductor-cost.json").read_text())
    assert record["command"].startswith("python -m bench.conductor.serve --instances 3")
    latency = [r for r in record["rows"] if "sustained" not in r]
    assert [(r["instances"], r["prompt_tokens"]) for r in latency] == [(3, 512), (3, 2048)]
    for row in latency:
        assert all(ms > 0 for ms in row["stages_mean_ms"].values()), row  # every stage timed by the Conductor
        assert row["ttft_ms"]["p50"] >= row["after_tokenization_mean_ms"] > 0
    (sustained,) = [r["sustained"] for r in record["rows"] if "sustained" in r]
    assert sustained["requests_per_s"] > 0 and sustained["errors"] == 0
    assert sustained["tokens"] == 16 * sustained["requests"]  # every request streamed its 16 tokens
    assert "| 3 | 2,048 |" in (out / "conductor-cost.md").read_text()
