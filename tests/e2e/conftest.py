"""The session's shared cluster for end-to-end tests, launched with `kvconductor up`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAR_SLOS, LocalCluster, running_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    """Two prefill, one decode and one colocated worker behind the Conductor and the gateway."""
    run_dir = tmp_path_factory.mktemp("cluster") / "run"
    with running_cluster(
        run_dir, model_dir, "prefill.node_count=2", "decode.node_count=1", "colocated.node_count=1", *FAR_SLOS
    ) as c:
        yield c
