"""The vLLM engine arguments of a worker: which KV connectors it runs, and the Store client's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from services.common.config import Config
from services.worker.engines.vllm_engine import engine_arguments

pytestmark = pytest.mark.vllm


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "environ", os.environ.copy())  # engine_arguments sets what vLLM reads at start-up
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = Config()
    config.cluster.host = "127.0.0.1"
    config.store.enabled, config.store.segment_mb = True, 64
    return config


def test_a_prefill_worker_with_the_store_runs_vllms_store_connector_beside_the_pd_one(config):
    arguments, bootstrap = engine_arguments(config, "prefill", "prefill-0", config.prefill, None, "127.0.0.1:5000")
    transfer = arguments["kv_transfer_config"]
    children = transfer.kv_connector_extra_config["connectors"]
    assert transfer.kv_connector == "StoreTierConnector" and bootstrap.startswith("http://127.0.0.1:")
    assert [c["kv_connector"] for c in children] == ["CpuMooncakeConnector", "CpuMooncakeStoreConnector"]
    assert transfer.kv_load_failure_policy == "recompute"  # a block the Store evicted after its lookup is computed
    with open(os.environ["MOONCAKE_CONFIG_PATH"]) as f:
        settings = json.load(f)
    assert (settings["master_server_address"], settings["global_segment_size"]) == ("127.0.0.1:5000", 64 << 20)
    assert (settings["metadata_server"], settings["protocol"]) == ("P2PHANDSHAKE", config.cluster.transfer_backend)


def test_without_a_store_master_a_worker_runs_the_pd_connector_alone_and_fails_a_kv_load_that_fails(config):
    for role, kv_role in (("prefill", "kv_both"), ("decode", "kv_consumer")):
        transfer = engine_arguments(config, role, f"{role}-0", config.prefill, None)[0]["kv_transfer_config"]
        assert (transfer.kv_connector, transfer.kv_role) == ("CpuMooncakeConnector", kv_role)
        assert transfer.kv_load_failure_policy == "fail" and "MOONCAKE_CONFIG_PATH" not in os.environ


def test_the_files_a_vllm_worker_leaves_in_the_temp_dir_go_when_it_exits(tmp_path):
    code = (f"import tempfile; tempfile.tempdir = {str(tmp_path)!r}\n"
            "from services.worker.engines.vllm_engine import worker_temp_path\n"
            "open(worker_temp_path('prefill-0', 'mooncake-store.json'), 'w').write('{}')\n"
            "worker_temp_path('prefill-0', 'kv-events.sock')  # never made: nothing to remove\n"
            "import glob; print(len(glob.glob(tempfile.tempdir + '/kvconductor-prefill-0-*')))\n")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "1" and not run.stderr
    assert list(tmp_path.iterdir()) == []
