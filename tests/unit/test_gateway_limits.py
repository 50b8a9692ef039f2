"""API keys and admission limits of the REST shim (in-process app; no cluster)."""

import logging

import openai
import pytest
from fastapi.testclient import TestClient

from services.common.config import config_from_dict
from services.gateway.gateway import create_app


def _app(keys, **gateway):
    config = config_from_dict(
        {"gateway": {"api_keys": keys, **gateway}, "model": {"path": "/nonexistent", "name": "m"}}
    )
    return create_app(config)


def test_requests_without_the_key_are_refused_with_openai_errors():
    client = TestClient(_app(["sk-good", "sk-other"]))
    for headers in ({}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good-but-not-bearer-x"}):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    for key in ("sk-good", "sk-other"):
        response = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
        assert response.json()["data"][0]["id"] == "m"


def test_every_route_but_health_needs_the_key():
    client = TestClient(_app(["sk-good"]))
    for method, path in (("GET", "/metrics"), ("GET", "/get_load"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):  # fmt: skip
        response = client.request(method, path, json={"model": "m", "prompt": "x", "messages": []})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
    metrics = client.get("/metrics", headers={"Authorization": "Bearer sk-good"})
    assert metrics.status_code == 200 and "kvconductor_http_requests_total" in metrics.text
    assert client.get("/health").status_code == 503  # open to probes: no Conductor behind this app


def test_the_openai_sdk_raises_authentication_error():
    app_client = TestClient(_app(["sk-good"]))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-bad", http_client=app_client, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.models.list()
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-good", http_client=app_client, max_retries=0)
    assert [m.id for m in sdk.models.list()] == ["m"]


def test_an_open_gateway_warns_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="services.gateway.gateway"):
        _app([])
    assert "api_keys" in caplog.text


def test_requests_beyond_the_concurrency_limit_get_429():
    app = _app([], max_concurrent_requests=2)
    app.state.gateway.in_flight = 2  # two generations in flight
    response = TestClient(app).post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 429
    assert "max_concurrent_requests" in response.json()["error"]["message"]


def test_idle_connections_outlive_every_common_clients_reuse_window():
    """Equal idle timeouts race: the server closes a connection as the client sends on it (a reset, ReadError)."""
    import httpx

    from services.gateway.gateway import server_config

    config = server_config(_app([]), "127.0.0.1", 0, "", "", "warning")
    clients = {"httpx / openai": httpx.Limits().keepalive_expiry, "aiohttp": 15.0, "AWS ALB": 60.0, "Go": 90.0}
    assert all(config.timeout_keep_alive > idle for idle in clients.values()), (config.timeout_keep_alive, clients)
