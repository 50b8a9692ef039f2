"""`kvconductor bench serve` against a real cluster."""

from __future__ import annotations

import json

from helpers import running_cluster

from cli.main import main


def test_bench_serve_against_a_cluster(tmp_path, model_dir):
    out = tmp_path / "serve.json"
    with running_cluster(tmp_path / "run", model_dir, "prefill.node_count=1", "decode.node_count=1") as cluster:
        args = ["bench", "serve", "--base-url", cluster.rest, "--model", "tiny-llama", "--workload", "shared-prefix",
                "--num-prefixes", "2", "--suffixes-per-prefix", "3", "--prefix-len", "64", "--suffix-len", "8",
                "--output-len", "4", "--concurrency", "2", "--quiet", "--out", str(out)]  # fmt: skip
        assert main(args) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("kvconductor ") and record["code"]  # (sys.argv: pytest's here)
    assert "prefix-cache hit rate" in out.with_suffix(".md").read_text()  # the summary beside it
    summary = record["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["ttft_ms"]["median"] > 0
    assert summary["prefix_cache_hit_rate"] > 0
