"""Which key a process sends, and which metadata the Conductor's check accepts."""

from services.common import api_keys
from services.common.config import Config


def test_a_process_sends_the_environment_key_else_the_first_configured(monkeypatch):
    config = Config()
    config.gateway.api_keys = ["first", "second"]
    monkeypatch.delenv(api_keys.ENV_KEY, raising=False)
    api_keys.use_api_key(config)
    assert api_keys.auth_metadata() == [("authorization", "Bearer first")]
    assert api_keys.auth_metadata("mine") == [("authorization", "Bearer mine")]
    monkeypatch.setenv(api_keys.ENV_KEY, "from-env")
    api_keys.use_api_key(config)
    assert api_keys.auth_metadata() == [("authorization", "Bearer from-env")]
    monkeypatch.delenv(api_keys.ENV_KEY)
    api_keys.use_api_key(Config())
    assert api_keys.auth_metadata() == []  # no keys anywhere: nothing sent


def test_the_check_takes_any_configured_key_and_nothing_else():
    check = api_keys.ApiKeyCheck(["k1", "k2"])
    assert check.valid([("authorization", "Bearer k2")])
    assert check.valid([("x-other", "1"), ("authorization", b"Bearer k1")])
    assert not check.valid([("authorization", "Bearer k3")])
    assert not check.valid([("authorization", "Bearer ")])
    assert not check.valid([])
    assert not check.valid(None)
