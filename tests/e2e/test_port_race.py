"""A port the launcher picked and another process took before the service bound it costs a restart, not the start.

On a busy machine a free port is free only when picked (``free_port`` binds port 0 and closes it): here two
sockets hold the ports the launcher picks for the Conductor and the gateway, as another job's would.
"""

from __future__ import annotations

import socket

import httpx
from helpers import TEST_OVERRIDES

from cli import launcher


def _held() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_the_conductor_and_gateway_start_on_other_ports_when_theirs_are_taken(tmp_path, model_dir, monkeypatch, capsys):
    held = [_held(), _held()]  # the first two ports picked: the Conductor's, then the gateway's
    taken = [s.getsockname()[1] for s in held]
    queue = list(taken)
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda: queue.pop(0) if queue else real())
    overrides = [f'model.path="{model_dir}"', 'model.name="tiny-llama"', 'model.source=""', *TEST_OVERRIDES,
                 "cluster.etcd_port=0", 'cluster.scheduler_endpoint="127.0.0.1:0"', "gateway.port=0",
                 "prefill.node_count=0", "decode.node_count=0", "colocated.node_count=1"]  # fmt: skip
    cluster = launcher.Cluster("deploy/config.toml", overrides, str(tmp_path / "run"))
    try:
        cluster.start()
        out = capsys.readouterr().out
        assert "conductor-0: another process took its port" in out and "gateway-0: another process" in out, out
        assert cluster.config.gateway.port not in taken
        assert int(cluster.config.cluster.scheduler_endpoint.rpartition(":")[2]) not in taken
        body = {"model": "tiny-llama", "prompt": [40, 41, 42], "max_tokens": 4, "temperature": 0}
        assert httpx.post(cluster.base_url + "/completions", json=body, timeout=60).status_code == 200
    finally:
        cluster.stop()
        for sock in held:
            sock.close()
