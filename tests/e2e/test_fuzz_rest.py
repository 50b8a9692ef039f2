"""Fuzzing the REST shim on a live cluster: every request gets a 200 or an OpenAI-shaped 4xx, never a 5xx or a hang.

Hypothesis builds the bodies (wrong types, missing fields, huge and negative numbers, NaN, empty and over-long
prompts, invalid UTF-8, malformed JSON, oversized and chunked bodies, wrong content types, streaming on and
off); schemathesis builds requests from the shim's own ``/openapi.json``. Each test ends by checking that the
cluster still answers a normal request. Bodies that would be valid always carry a small ``max_tokens`` so a run
stays short; timeouts only detect hangs. ``KVCONDUCTOR_FUZZ_EXAMPLES`` sets the examples per test (``make fuzz``
raises it); ``derandomize`` makes every run send the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fuzzing import CONTEXT, FUZZ, MAX_NEW, MODEL, VOCAB
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NotSet

MAX_BODY = 1 << 20  # [gateway] max_request_bytes
TIMEOUT = httpx.Timeout(60.0)  # detects a hang; never a performance bound

# -- strategies --------------------------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
TEXT = st.text(max_size=60)  # any code point but surrogates: emoji, NUL, RTL marks, combining characters
TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=40)
# max_tokens: small when valid, else rejected (zero, negative, past the context, past uint32, wrong type).
# Never a valid large count: a run must stay short.
BAD_MAX = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=CONTEXT),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not (abs(f) < 2**53 and f == int(f))),
    st.text(max_size=8).filter(lambda s: not any(c.isdigit() for c in s)),
    st.lists(st.integers(), max_size=2),
)

VALID_SAMPLING = {
    "temperature": st.floats(min_value=0.0, max_value=2.0),
    "top_p": st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    "top_k": st.integers(min_value=0, max_value=2**32 - 1),
    "seed": st.integers(min_value=0, max_value=2**63 - 1),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "n": st.just(1),
    "user": st.text(max_size=8),
    "echo": st.booleans(),  # an unknown field: accepted and ignored
}
OUT_OF_UINT32 = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32))
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none())})
BAD = {  # per field: wrong types and out-of-range values
    "model": st.one_of(TEXT, JUNK),
    "max_tokens": BAD_MAX,
    "prompt": st.one_of(
        st.just(""),
        st.just([]),
        st.lists(TEXT, min_size=2, max_size=3),  # batched prompts are refused
        st.lists(st.integers(min_value=VOCAB, max_value=2**32 - 1), min_size=1, max_size=4),  # outside the vocab
        st.lists(OUT_OF_UINT32, min_size=1, max_size=4),
        JUNK,
    ),
    "messages": st.one_of(
        st.just([]),
        st.lists(st.fixed_dictionaries({}, optional={"role": st.one_of(TEXT, JUNK), "content": JUNK}), min_size=1),
        st.lists(st.fixed_dictionaries({"role": ROLE, "content": st.lists(JUNK, min_size=1)}), min_size=1),
        JUNK,
    ),
    "temperature": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=2.0001), st.just(float("nan")), JUNK),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(float("nan")), JUNK),
    "top_k": st.one_of(OUT_OF_UINT32, JUNK),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), JUNK),
    "n": st.one_of(st.integers(max_value=0), st.integers(min_value=2), JUNK),
    "stop": st.one_of(st.lists(JUNK, min_size=1), st.integers(), st.dictionaries(TEXT, TEXT, min_size=1)),
    "stop_token_ids": st.one_of(st.lists(OUT_OF_UINT32, min_size=1), st.lists(JUNK, min_size=1), st.integers()),
    "stream": st.one_of(st.integers(min_value=2), st.lists(st.booleans(), min_size=1), st.text(min_size=6, max_size=9)),
    "stream_options": st.one_of(st.integers(), st.fixed_dictionaries({"include_usage": st.lists(st.booleans())})),
    "ignore_eos": st.one_of(st.integers(min_value=2), st.lists(st.booleans(), min_size=1)),
}
MISSING = object()


def completion_body() -> st.SearchStrategy[dict[str, Any]]:
    """A valid /v1/completions body (text, token ids or a one-element list of text)."""
    prompt = st.one_of(TEXT.filter(bool), TOKEN_IDS, st.lists(TEXT.filter(bool), min_size=1, max_size=1))
    return _body({"model": st.just(MODEL), "prompt": prompt})


def chat_body() -> st.SearchStrategy[dict[str, Any]]:
    """A valid /v1/chat/completions body."""
    return _body({"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=4)})


def _body(required: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    # Always a small max_tokens: a missing one means up to the context length, too slow to fuzz.
    required = {**required, "max_tokens": st.integers(min_value=1, max_value=MAX_NEW)}
    return st.fixed_dictionaries(required, optional=VALID_SAMPLING)


@st.composite
def one_field_wrong(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid body with one field of the wrong type or out of range, or one required field missing.

    One fault at a time reaches past validation into the code behind it, where many faults at once would all
    stop at the first check.
    """
    body = draw(valid)
    key = draw(st.sampled_from(sorted(k for k in BAD if k in body or k in VALID_SAMPLING)))
    required = key in ("model", "prompt", "messages")
    value = draw(st.one_of(BAD[key], st.just(MISSING)) if required else BAD[key])
    if value is MISSING:
        del body[key]
    else:
        body[key] = value
    return body


# -- checks ------------------------------------------------------------------------------------------------------


def assert_openai_error(response: httpx.Response) -> None:
    """A 4xx whose body is ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error


def assert_served_or_refused(response: httpx.Response, valid: bool | None = None) -> None:
    """200 with a well-formed completion (or SSE stream), or an OpenAI-shaped 4xx; ``valid`` pins which."""
    if response.status_code != 200:
        # 429 is an SLO rejection: legitimate for a valid request on a busy machine.
        assert valid is not True or response.status_code == 429, f"{response.status_code}: {response.text[:500]}"
        assert_openai_error(response)
        return
    assert valid is not False, f"accepted an invalid request: {response.text[:500]}"
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks), chunks
    elif "tokens" in (reply := response.json()):  # /tokenize
        assert reply["count"] == len(reply["tokens"]), reply
    else:
        assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
        assert 1 <= reply["usage"]["completion_tokens"] <= MAX_NEW, reply


def post(http: httpx.Client, path: str, **kwargs: Any) -> httpx.Response:
    """POST and read the whole response (all of a stream) within the hang timeout."""
    with http.stream("POST", path, **kwargs) as response:
        response.read()
    return response


def send_json(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """JSON as Python writes it, NaN and Infinity included (the shim's parser accepts them)."""
    content = json.dumps(body, allow_nan=True, default=str).encode()
    return post(http, path, content=content, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def http(cluster: Any) -> Iterator[httpx.Client]:
    base = cluster.rest.removesuffix("/v1")
    with httpx.Client(base_url=base, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(autouse=True)
def still_serves(http: httpx.Client) -> Iterator[None]:
    """After each test: the cluster still completes a normal request."""
    yield
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    response = post(http, "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# -- hypothesis: bodies ------------------------------------------------------------------------------------------


@FUZZ
@given(body=completion_body())
def test_valid_completions_are_served(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_served_or_refused(send_json(http, "/v1/completions", body), valid=True)


@FUZZ
@given(body=chat_body())
def test_valid_chat_completions_are_served(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_served_or_refused(send_json(http, "/v1/chat/completions", body), valid=True)


@FUZZ
@given(body=one_field_wrong(completion_body()))
def test_any_completions_body_is_served_or_refused(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_served_or_refused(send_json(http, "/v1/completions", body))


@FUZZ
@given(body=one_field_wrong(chat_body()))
def test_any_chat_body_is_served_or_refused(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_served_or_refused(send_json(http, "/v1/chat/completions", body))


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]),
    content=st.one_of(st.binary(max_size=200), TEXT.map(str.encode)),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", None]),
)
def test_raw_bodies_are_refused(http: httpx.Client, path: str, content: bytes, content_type: str | None) -> None:
    """Malformed JSON, invalid UTF-8, bare bytes under any content type: never parsed into a request."""
    headers = {"content-type": content_type} if content_type else {}
    assert_served_or_refused(post(http, path, content=content, headers=headers))


@FUZZ
@given(body=st.recursive(JUNK, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3)))
def test_any_json_value_is_refused(http: httpx.Client, body: Any) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_error(send_json(http, path, body))


@FUZZ
@given(
    path=st.sampled_from(["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/nope", "/"]),
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
)
def test_wrong_paths_and_methods_get_openai_errors(http: httpx.Client, path: str, method: str) -> None:
    response = http.request(method, path)
    if method == "GET" and path == "/v1/models":
        assert response.json()["data"][0]["id"] == MODEL
    else:
        assert_openai_error(response)


@FUZZ
@given(prompt=TEXT, model=st.one_of(st.none(), st.just(MODEL), TEXT))
def test_tokenize(http: httpx.Client, prompt: str, model: str | None) -> None:
    response = send_json(http, "/tokenize", {"prompt": prompt} | ({"model": model} if model is not None else {}))
    if model in (None, MODEL):
        assert response.status_code == 200, response.text
        reply = response.json()
        assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == CONTEXT
    else:
        assert response.status_code == 404
        assert_openai_error(response)


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_bodies_get_413(http: httpx.Client, chunked: bool) -> None:
    """Over [gateway] max_request_bytes, whether the size is declared (Content-Length) or not (chunked)."""
    body = json.dumps({"model": MODEL, "prompt": "a" * MAX_BODY, "max_tokens": 1}).encode()
    content: Any = iter([body[i : i + 65536] for i in range(0, len(body), 65536)]) if chunked else body
    response = post(http, "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert_openai_error(response)


@pytest.mark.parametrize("tokens", [CONTEXT - 1, CONTEXT, CONTEXT + 1, 3 * CONTEXT])
def test_over_long_prompts_are_400s(http: httpx.Client, tokens: int) -> None:
    """A prompt that leaves no room for one new token (or exceeds the context) is a 400 naming the context."""
    for body in (
        {"model": MODEL, "prompt": "a" * tokens, "max_tokens": 2},
        {"model": MODEL, "prompt": [97] * tokens, "max_tokens": 2, "stream": True},
    ):
        response = send_json(http, "/v1/completions", body)
        assert response.status_code == 400, response.text
        assert "context length" in response.json()["error"]["message"]


# -- schemathesis: requests from the shim's OpenAPI schema -------------------------------------------------------


def _bounded(body: Any) -> Any:
    """Cap the token limit of a body that could be valid, so no example generates for long."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        try:
            number = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is not None and MAX_NEW < number < CONTEXT:
            body[key] = MAX_NEW
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW
    return body


@pytest.fixture(scope="module")
def openapi(cluster: Any) -> Any:
    base = cluster.rest.removesuffix("/v1")
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_openapi_schema_fuzz(openapi: Any, http: httpx.Client, path: str, mode: GenerationMode) -> None:
    """Bodies built from the shim's own schema, conforming (positive) and not (negative)."""
    operation = openapi[path]["POST"]

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if isinstance(case.body, NotSet):
            response = post(http, path)
        elif isinstance(case.body, bytes):  # negative cases include bodies of other media types
            response = post(http, path, content=case.body, headers={"content-type": case.media_type or "text/plain"})
        else:
            response = send_json(http, path, _bounded(case.body))
        assert_served_or_refused(response, valid=None)

    run()
