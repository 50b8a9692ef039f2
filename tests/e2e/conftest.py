"""The session's shared cluster for end-to-end tests, launched with `kvconductor up`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import LocalCluster, launch_cluster, stop_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    """Two prefill, one decode and one colocated worker behind the Conductor and the gateway."""
    run_dir = tmp_path_factory.mktemp("cluster") / "run"
    # SLOs far beyond any latency here: these tests are about behaviour, and a busy machine must not turn a
    # long prompt into an admission rejection (admission has its own tests and clusters).
    slos = ("prefill.max_ttft_ms=60000", "colocated.max_ttft_ms=60000", "decode.max_tbt_ms=10000",
            "colocated.max_tbt_ms=10000")  # fmt: skip
    c = launch_cluster(
        run_dir, model_dir, "prefill.node_count=2", "decode.node_count=1", "colocated.node_count=1", *slos
    )
    try:
        yield c
    finally:
        stop_cluster(c.process)
