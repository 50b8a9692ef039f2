"""Bounds on what a client sends, checked before per-token or per-item work on an event loop (issue 27).

``bench/serve/neighbours.py`` measures the streams beside such requests; these pin the order of the checks.
"""

import asyncio
import os
import re
import struct
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from tokenizers import normalizers

import engine.tokenizer
from engine.tokenizer import TooManyTokens, build_byte_level_tokenizer, max_token_bytes, tokenize_off_loop
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


async def test_a_text_whose_bytes_prove_it_too_long_is_refused_without_tokenizing(monkeypatch):
    tokenizer = build_byte_level_tokenizer()
    assert max_token_bytes(tokenizer) == len("<|start_header_id|>")  # the longest token: a special one
    monkeypatch.setattr("engine.tokenizer._ids", lambda *a: pytest.fail("tokenized a text its bytes refuse"))
    with pytest.raises(TooManyTokens) as refused:
        await tokenize_off_loop(tokenizer, "é" * 1000, max_tokens=100)  # 2,000 bytes: at least 2000 // 19
    assert refused.value.at_least and refused.value.count == 2000 // 19


def test_no_bytes_bound_is_claimed_where_a_normalizer_may_shrink_the_text():
    tokenizer = build_byte_level_tokenizer()
    tokenizer.normalizer = normalizers.NFC()
    assert max_token_bytes(tokenizer) is None


async def test_tokenizing_runs_at_the_lowest_cpu_priority():
    async def nice_of_the_thread() -> int:
        loop = asyncio.get_running_loop()
        tokenizer = build_byte_level_tokenizer()
        await tokenize_off_loop(tokenizer, "warm the pool")
        return await loop.run_in_executor(engine.tokenizer._pool, os.getpriority, os.PRIO_PROCESS, 0)

    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert await nice_of_the_thread() == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the calling thread keeps its own


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

    conductor = SimpleNamespace(tokenizer=build_byte_level_tokenizer(), _packed=scanned)
    with pytest.raises(ValueError, match="the prompt has 50 tokens; this model's context length is 50"):
        await ConductorServicer._prompt_ids(conductor, request_, 50)  # type: ignore[arg-type]
    conductor._packed = lambda ids: b"packed"
    prompt, packed = await ConductorServicer._prompt_ids(conductor, request_, 51)  # type: ignore[arg-type]
    assert len(prompt) == 50 and packed == b"packed"


def _conductor_with_vocab(size: int) -> SimpleNamespace:
    conductor = SimpleNamespace(
        tokenizer=build_byte_level_tokenizer(),
        view=SimpleNamespace(instances={"w": SimpleNamespace(record=SimpleNamespace(vocab_size=size))}),
    )
    conductor._packed = lambda ids: ConductorServicer._packed(conductor, ids)  # type: ignore[arg-type]
    return conductor


async def test_token_ids_are_checked_against_the_vocabulary_as_they_are_packed_for_hashing():
    conductor = _conductor_with_vocab(100)
    ids = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[5, 99, 7]))
    prompt, packed = await ConductorServicer._prompt_ids(conductor, ids, 10)  # type: ignore[arg-type]
    assert list(prompt) == [5, 99, 7] and packed == struct.pack("<3I", 5, 99, 7)
    ids.token_ids.ids.append(100)
    with pytest.raises(ValueError, match=re.escape("token id 100 is outside the vocabulary (size 100)")):
        await ConductorServicer._prompt_ids(conductor, ids, 10)  # type: ignore[arg-type]


async def test_a_text_prompt_is_packed_and_checked_the_same_way():
    text = conductor_pb2.GenerateRequest(text="hi")
    prompt, packed = await ConductorServicer._prompt_ids(_conductor_with_vocab(512), text, 10)  # type: ignore[arg-type]
    assert prompt and packed == struct.pack(f"<{len(prompt)}I", *prompt)
    small = max(prompt)  # a worker whose vocabulary lacks the tokenizer's largest id
    with pytest.raises(ValueError, match=re.escape(f"token id {small} is outside the vocabulary (size {small})")):
        await ConductorServicer._prompt_ids(_conductor_with_vocab(small), text, 10)  # type: ignore[arg-type]


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


def test_the_gateway_refuses_a_prompt_its_bytes_prove_too_long_without_calling_a_conductor(model_dir):
    config = config_from_dict({"model": {"path": str(model_dir), "name": "m"}})
    app = create_app(config, discover=False)
    context = app.state.gateway.tokenizer()[1]
    app.state.gateway.conductors.generate = lambda request: pytest.fail("a provably too long prompt was sent on")
    client = TestClient(app)
    for path, body in (
        ("/v1/completions", {"prompt": "x" * (context * 19)}),  # 19: the byte-level tokenizer's longest token
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (context * 19)}]}),
    ):
        response = client.post(path, json={"model": "m", **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        expected = rf"the prompt has at least \d+ tokens; this model's context length is {context}"
        assert re.fullmatch(expected, error["message"])


def test_the_gateways_context_is_the_one_emulated_workers_serve_not_the_model_files(model_dir):
    """An emulated engine loads only the model's tokenizer and config: its context is ``[emulation]``'s."""
    declared = config_from_dict({"model": {"path": str(model_dir), "name": "m"}})
    emulated = config_from_dict({"model": {"path": str(model_dir), "name": "m"}, "engine": {"backend": "emulated"},
                                 "emulation": {"max_model_len": 131072}})  # fmt: skip
    assert create_app(declared, discover=False).state.gateway.tokenizer()[1] < 131072
    gateway = create_app(emulated, discover=False).state.gateway
    assert gateway.tokenizer()[1] == 131072
    gateway.refuse_long_prompt("x" * 100_000)  # beyond the model files' context, within the emulated one
