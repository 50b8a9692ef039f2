"""Bounds on what a client sends, checked before per-token or per-item work on an event loop (issue 27).

``bench/serve/neighbours.py`` measures the streams beside such requests; these pin the order of the checks.
"""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from engine.tokenizer import TooManyTokens, build_byte_level_tokenizer, tokenize_off_loop
from kvconductor.v1 import conductor_pb2
from services.common.config import config_from_dict
from services.conductor.conductor import ConductorServicer
from services.gateway.gateway import create_app
from services.gateway.openai_protocol import MOST_ITEMS, CompletionRequest


async def test_a_text_over_the_token_bound_is_refused_before_its_ids_become_python_ints():
    tokenizer = build_byte_level_tokenizer()
    assert await tokenize_off_loop(tokenizer, "hello", max_tokens=5) == list(b"hello")
    with pytest.raises(TooManyTokens) as refused:
        await tokenize_off_loop(tokenizer, "hello!", max_tokens=5)
    assert refused.value.count == 6
    assert await tokenize_off_loop(tokenizer, "x" * 100) == [ord("x")] * 100  # no bound


@pytest.mark.parametrize(
    "request_",
    [
        conductor_pb2.GenerateRequest(text="x" * 50),
        conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[1] * 50)),
    ],
    ids=["text", "token_ids"],
)
async def test_the_conductor_refuses_an_over_long_prompt_before_scanning_it(request_):
    def scanned(ids):
        raise AssertionError("the vocabulary scan ran on an over-long prompt")

    conductor = SimpleNamespace(tokenizer=build_byte_level_tokenizer(), _check_vocab=scanned)
    with pytest.raises(ValueError, match="the prompt has 50 tokens; this model's context length is 50"):
        await ConductorServicer._prompt_ids(conductor, request_, 50)  # type: ignore[arg-type]
    conductor._check_vocab = lambda ids: None
    assert len(await ConductorServicer._prompt_ids(conductor, request_, 51)) == 50  # type: ignore[arg-type]


def test_the_gateway_refuses_more_stop_strings_or_ids_than_any_config_allows_itself():
    for field, (key, most) in MOST_ITEMS.items():
        item = "s" if field == "stop" else 1
        CompletionRequest.model_validate({"model": "m", "prompt": "p", field: [item] * most})
        with pytest.raises(ValueError, match=key):
            CompletionRequest.model_validate({"model": "m", "prompt": "p", field: [item] * (most + 1)})
    app = create_app(config_from_dict({"model": {"path": "/nonexistent", "name": "m"}}), discover=False)
    for path, body in (
        ("/v1/completions", {"prompt": "p"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "p"}]}),
    ):
        # no Conductor behind this app: the answer is the gateway's own
        response = TestClient(app).post(path, json={"model": "m", "stop": ["s"] * 100_000, **body})
        assert response.status_code == 400, response.text
        assert "max_stop_strings" in response.json()["error"]["message"]
