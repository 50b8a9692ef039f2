"""``kvconductor plan``: the search over deployments, the config it writes, its answer to a rate and a budget."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from bench import plan
from cli.main import main as kvconductor
from services.common.config import load_config

SLOS = ("--ttft-slo-ms", "2000", "--tbt-slo-ms", "100")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """120 requests, 1 req/s: 6 shared 2-block prefixes, then 4-8 blocks of their own (Mooncake format, 512-token
    blocks). On the analytic GPU profile 2 instances serve 4 req/s within the SLOs but not 5; 3 do."""
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    lines = []
    for i in range(120):
        prefix = rng.randrange(6)
        blocks = [prefix * 100 + b for b in range(2)] + [10_000 + i * 10 + b for b in range(rng.randrange(4, 9))]
        tokens = 512 * (len(blocks) - 1) + rng.randrange(1, 513)
        lines.append(json.dumps({"timestamp": i * 1000, "input_length": tokens, "output_length": rng.randrange(50, 400),
                                 "hash_ids": blocks}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_split_of_n_instances_is_a_candidate():
    labels = [c.label for c in plan.candidates(4, plan.DEPLOYMENTS)]
    assert labels == ["4 colocated", "1P+3D", "2P+2D", "3P+1D", "1P+3C", "2P+2C", "3P+1C"]
    assert [c.label for c in plan.candidates(3, ["conditional"])] == ["1P+2C", "2P+1C"]


@pytest.mark.parametrize("candidate", plan.candidates(3, plan.DEPLOYMENTS), ids=lambda c: c.label)
def test_the_written_config_loads_as_the_launcher_loads_it(candidate, tmp_path):
    bed = plan.Bed(Path("t"), None, None, plan.named_profile("analytic-gpu"), 5.0, 0.2, "dynamo", 0.0, 0, 1.0)
    knobs = plan.Knobs(2.0, 4096, 96)
    path = tmp_path / "plan.toml"
    path.write_text(plan.config_toml(candidate, knobs, bed, ["a header"]))
    config = load_config(path)  # every key it wrote is one this deployment reads
    counts = candidate.node_counts()
    assert (config.prefill.node_count, config.decode.node_count, config.colocated.node_count) == (
        counts["prefill"], counts["decode"], counts["colocated"])  # fmt: skip
    assert config.scheduler.kv_cache_balancing_threshold == 2.0
    slo_pool = config.prefill if candidate.deployment == "disaggregated" else config.colocated
    assert slo_pool.max_ttft_ms == 5000 and slo_pool.max_num_batched_tokens == 4096
    if candidate.deployment == "conditional":
        assert config.scheduler.disaggregation == "dynamo"


def test_a_budget_ranks_every_deployment_and_writes_the_best(trace, tmp_path, capsys, monkeypatch):
    out = tmp_path / "plan"
    args = ["plan", "--instances", "3", "--trace", str(trace), *SLOS, "--jobs", "1", "--no-tune", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["kvconductor", *args])  # the command the plan records
    assert kvconductor(args) == 0
    record = json.loads((out / "plan.json").read_text())
    capacities = {label: c["capacity"] or 0.0 for label, c in record["candidates"].items()}
    assert len(capacities) == 5 and record["chosen"] == max(capacities, key=capacities.__getitem__)
    assert record["capacity"] == capacities[record["chosen"]] > 0
    assert record["command"].startswith("kvconductor plan --instances 3")
    chosen = next(c for c in plan.candidates(3, plan.DEPLOYMENTS) if c.label == record["chosen"])
    config = load_config(out / "plan.toml")
    assert config.prefill.node_count == chosen.node_counts()["prefill"]
    assert (out / "plan.png").stat().st_size > 0
    assert f"kvconductor plan: {record['chosen']}" in capsys.readouterr().out


def test_a_rate_gets_the_fewest_instances_that_meet_it(trace, tmp_path):
    out = tmp_path / "plan"
    args = ["plan", "--rate", "5", "--trace", str(trace), *SLOS, "--jobs", "1", "--no-tune", "--out", str(out),
            "--min-instances", "2", "--max-instances", "6"]  # fmt: skip
    assert kvconductor(args) == 0
    record = json.loads((out / "plan.json").read_text())
    n = record["instances"]
    assert n == 3 and record["capacity"] >= 5.0
    assert [s["instances"] for s in record["search"]] == [2, 3] and record["search"][0]["attainment"] < 0.9
    bed = plan.Bed(trace, None, None, plan.named_profile("analytic-gpu"), 2.0, 0.1, "cost", 0.0, 0, 1.0)
    knobs = plan.Knobs(plan.SimConfig().kv_cache_balancing_threshold, bed.profile.chunk_tokens, bed.profile.max_running)
    assert all(bed.attainment(c, knobs, 5.0) < plan.ATTAINMENT for c in plan.candidates(2, plan.DEPLOYMENTS))


def test_an_unreachable_rate_says_so(trace, tmp_path, capsys):
    args = ["plan", "--rate", "500", "--trace", str(trace), *SLOS, "--jobs", "1", "--no-tune",
            "--out", str(tmp_path / "plan"), "--max-instances", "3"]  # fmt: skip
    assert kvconductor(args) == 1
    assert "no deployment of up to 3 instances meets the SLOs at 500 req/s" in capsys.readouterr().err
