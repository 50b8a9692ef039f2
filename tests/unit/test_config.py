import subprocess
import sys

import pytest

from services.common.config import ConfigError, config_from_dict, load_config


def test_defaults_are_valid_and_the_deploy_config_loads():
    config = load_config("deploy/config.toml")
    assert config.prefill.prefix_cache_block_size == 16
    assert config.scheduler.kv_cache_balancing_threshold == 1.2
    assert config.cluster.etcd_endpoints == []


@pytest.mark.parametrize(("path", "backend"), [("deploy/vllm.toml", "vllm"), ("deploy/emulated.toml", "emulated")])
def test_the_other_deploy_configs_load(path, backend):
    config = load_config(path)
    assert config.engine.backend == backend


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"prefill": {"max_num_batched_tokens": 0}}, "[prefill] max_num_batched_tokens"),
        ({"prefill": {"max_num_bached_tokens": 8}}, "[prefill] max_num_bached_tokens: unknown key"),
        ({"decoder": {}}, "[decoder]: unknown section"),
        ({"decode": {"max_tbt_ms": "fast"}}, "[decode] max_tbt_ms: must be a number"),
        ({"cluster": {"transfer_backend": "udp"}}, "[cluster] transfer_backend"),
        ({"cluster": {"scheduler_endpoint": "nohost"}}, "[cluster] scheduler_endpoint"),
        ({"cluster": {"grpc_port": 70000}}, "[cluster] grpc_port"),
        ({"decode": {"prefix_cache_block_size": 32}}, "[decode] prefix_cache_block_size"),
        ({"prefill": {"enable_prefix_caching": 1}}, "[prefill] enable_prefix_caching: must be true or false"),
        ({"prefill": {"node_count": 0}, "colocated": {"node_count": 0}}, "node_count"),
        (
            {"decode": {"gpu_memory_utilization": 0.85}},
            "[decode] gpu_memory_utilization: removed: it scaled "
            "kv_cache_memory_mb, which is now the KV pool's size itself",
        ),
        ({"prefill": {"min_mfu": 0.35}}, "[prefill] min_mfu: removed: it was never enforced"),
        (
            {"decode": {"max_ttft_ms": 500}},
            "[decode] max_ttft_ms: is never read: the SLO of this path is [prefill]",
        ),
        (
            {"prefill": {"max_tbt_ms": 50}},
            "[prefill] max_tbt_ms: is never read: the SLO of this path is [decode]",
        ),
        ({"gateway": {"api_keys": ["k", " "]}}, "[gateway] api_keys: an empty key would let anyone in"),
        (
            {
                "engine": {"backend": "vllm"},
                "prefill": {"prefix_cache_block_size": 32},
                "decode": {"prefix_cache_block_size": 32, "node_count": 0},
                "colocated": {"prefix_cache_block_size": 32, "node_count": 1},
            },
            "[prefill] node_count: prefill workers beside colocated ones",
        ),
        ({"store": {"read_timeout_s": 0}}, "[store] read_timeout_s: must be > 0"),
        ({"scheduler": {"local_tbt_headroom": 1.0}}, "[scheduler] local_tbt_headroom: must be >= 0 and < 1"),
        ({"emulation": {"kv_bytes_per_token": 24}}, "[emulation] kv_bytes_per_token: must be a positive multiple"),
        (
            {"engine": {"backend": "emulated"}, "emulation": {"profile": "h100.json"}},
            "[emulation] profile: no profile 'h100.json'",
        ),
        (
            {
                "engine": {"backend": "emulated"},
                "prefill": {"kv_cache_dtype": "fp8"},
                "decode": {"kv_cache_dtype": "fp8"},
            },
            '[prefill] kv_cache_dtype: must be "auto" with [engine] backend = "emulated"',
        ),
    ],
)
def test_bad_values_name_the_key(data, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(data)


def test_seed_endpoint_with_scheme_is_accepted():
    config = config_from_dict({"cluster": {"scheduler_endpoint": "http://127.0.0.1:8998"}})
    assert config.cluster.scheduler_endpoint == "127.0.0.1:8998"


def test_overrides_parse_toml_values_and_name_bad_keys(tmp_path):
    config = load_config(None, ["prefill.node_count=3", 'cluster.etcd_endpoints=["127.0.0.1:1"]', "model.name=x y"])
    assert config.prefill.node_count == 3
    assert config.cluster.etcd_endpoints == ["127.0.0.1:1"]
    assert config.model.name == "x y"
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["node_count=3"])


def test_cli_stops_on_a_bad_config_with_the_key_in_the_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nkv_cache_balancing_threshold = -1\n")
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "up", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "[scheduler] kv_cache_balancing_threshold" in result.stderr
    assert "Traceback" not in result.stderr
