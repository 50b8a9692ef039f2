"""The trust model at start-up: loopback alone is trusted; off it, every port needs its credential."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.config import ConfigError, check_trust, config_from_dict, exposed_addresses, load_config

TLS = {"tls_cert_file": "c", "tls_key_file": "k", "tls_ca_file": "a"}  # never opened by check_trust


def config(cluster=None, gateway=None):
    c = config_from_dict(
        {"cluster": {k: v for k, v in (cluster or {}).items() if k not in TLS}, "gateway": gateway or {}}
    )
    for key, value in (cluster or {}).items():
        if key in TLS:
            setattr(c.cluster, key, value)  # past validate, which would look for the files
    return c


def test_the_defaults_bind_loopback_only_and_need_nothing():
    c = config()
    assert exposed_addresses(c) == []
    check_trust(c)


@pytest.mark.parametrize(
    ("cluster", "gateway", "role", "named"),
    [
        (
            {"host": "10.0.0.5"},
            {},
            "prefill",
            r"\[cluster\] host: 10.0.0.5 is not a loopback address: set \[cluster\] tls_",
        ),
        ({"scheduler_endpoint": "conductor:8998"}, {}, "gateway", r"\[cluster\] scheduler_endpoint: conductor is"),
        ({"etcd_endpoints": ["10.0.0.9:2379"]}, {}, "kvmeta", r"\[cluster\] etcd_endpoints: 10.0.0.9 .* etcd_ca_file"),
        ({"etcd_endpoints": ["[::1]:2379", "e:2379"]}, {}, "conductor", r"\[cluster\] etcd_endpoints: e is"),
        ({}, {"host": "0.0.0.0"}, "gateway", r"\[gateway\] host: 0.0.0.0 .* \[gateway\] api_keys_file"),
        ({"host": "10.0.0.5", **TLS}, {}, "colocated", r"\[cluster\] host: .* api_keys_file"),  # its OpenAI port
    ],
)
def test_an_exposed_address_without_its_credential_is_refused_naming_the_key(cluster, gateway, role, named):
    c = config(cluster, gateway)
    with pytest.raises(ConfigError, match=named):
        check_trust(c, role)
    c.cluster.insecure_network = True
    check_trust(c, role)  # the opt-out lets it start (cli/main.py logs a warning)


def test_the_zmq_event_feed_has_no_credential_so_off_loopback_only_the_opt_out_allows_it():
    c = config({"host": "10.0.0.5", **TLS})
    c.engine.zmq_kv_events = True
    with pytest.raises(ConfigError, match=r"\[engine\] zmq_kv_events: 10.0.0.5 .* zmq_kv_events = false"):
        check_trust(c, "prefill")
    check_trust(c, "conductor")  # the Conductor opens no feed
    c.cluster.host = "127.0.0.1"
    check_trust(c, "prefill")
    c.cluster.host, c.cluster.insecure_network = "10.0.0.5", True
    check_trust(c, "prefill")


def test_each_credential_clears_its_address():
    check_trust(config({"host": "10.0.0.5", **TLS}), "prefill")
    etcd = config({"etcd_endpoints": ["e:2379"], "etcd_user": "w"})
    with pytest.raises(ConfigError, match="etcd_ca_file"):
        check_trust(etcd, "prefill")  # a password alone would cross the network in the clear
    etcd.cluster.etcd_ca_file = "ca"
    check_trust(etcd, "prefill")
    check_trust(config(gateway={"host": "0.0.0.0", "api_keys": ["k"]}), "gateway")
    check_trust(config(gateway={"host": "0.0.0.0"}), "prefill")  # only the gateway binds [gateway] host


def test_keys_come_from_a_file_never_from_the_command_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-one\n\n  sk-two  \n")
    c = load_config(None, [f'gateway.api_keys_file="{keys}"'])
    assert c.gateway.api_keys == ["sk-one", "sk-two"]
    with pytest.raises(ConfigError, match="--set gateway.api_keys: keys never go on the command line"):
        load_config(None, ['gateway.api_keys=["sk-one"]'])
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ConfigError, match=r"\[gateway\] api_keys_file: .* holds no key"):
        load_config(None, [f'gateway.api_keys_file="{tmp_path / "empty"}"'])
    with pytest.raises(ConfigError, match=r"\[gateway\] api_keys_file: no such file"):
        load_config(None, [f'gateway.api_keys_file="{tmp_path / "missing"}"'])


def test_serve_refuses_an_exposed_plaintext_worker_before_loading_anything():
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "prefill", "--id", "p", "--set", 'cluster.host="10.0.0.5"'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "config error: [cluster] host: 10.0.0.5 is not a loopback address" in result.stderr


def test_etcd_roles_says_what_it_needs_and_a_role_file_that_is_missing_is_named(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cli.main", "etcd-roles"], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 1 and "etcd_cert_file and etcd_key_file" in result.stderr and "CN=root" in result.stderr
    c = config()
    c.cluster.etcd_cert_file = str(tmp_path / "{role}.pem")
    (tmp_path / "prefill.pem").touch()
    assert c.cluster.for_role("prefill").etcd_cert_file == str(tmp_path / "prefill.pem")
    with pytest.raises(ConfigError, match=r"\[cluster\] etcd_cert_file: no such file for role root"):
        c.cluster.for_role("root")
