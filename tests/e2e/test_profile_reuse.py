"""A second start of the same cluster reuses each worker's start-up profile, and serves the same tokens."""

from __future__ import annotations

from pathlib import Path

from helpers import grpc_generate, running_cluster

from kvconductor.v1 import conductor_pb2

PD = conductor_pb2.DEPLOYMENT_DISAGGREGATED
PROMPT = list(range(40, 140))


def _worker_logs(cluster) -> str:
    processes = cluster.manifest["processes"].values()
    return "\n".join(Path(p["log"]).read_text() for p in processes if p["role"] in ("prefill", "decode"))


def test_the_second_start_reuses_every_workers_profile(tmp_path_factory, model_dir):
    kept = tmp_path_factory.mktemp("profiles")
    overrides = (f'engine.profile_cache_dir="{kept}"', "prefill.node_count=1", "decode.node_count=1")
    with running_cluster(tmp_path_factory.mktemp("first") / "run", model_dir, *overrides) as first:
        logs = _worker_logs(first)
        assert logs.count("profiled in") == 2 and "reusing the start-up profile" not in logs
        tokens, _, _ = grpc_generate(first, PROMPT, PD)
    assert len(list(kept.iterdir())) == 2  # prefill and decode run differently: one profile each
    with running_cluster(tmp_path_factory.mktemp("second") / "run", model_dir, *overrides) as second:
        logs = _worker_logs(second)
        assert logs.count("reusing the start-up profile") == 2 and "profiled in" not in logs
        assert grpc_generate(second, PROMPT, PD)[0] == tokens
