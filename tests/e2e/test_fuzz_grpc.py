"""Fuzzing the Conductor's ``Generate`` on a live cluster with hypothesis-built ``GenerateRequest`` messages.

Property: a call streams to a finish (finish reason and usage on the last message) or fails fast with
INVALID_ARGUMENT, NOT_FOUND or RESOURCE_EXHAUSTED (an SLO rejection); never INTERNAL, UNKNOWN or a hang, and
the cluster still serves afterwards. Requests that could run carry a small ``max_tokens``; the call timeout
only detects hangs. ``KVCONDUCTOR_FUZZ_EXAMPLES`` sets the examples per test (``make fuzz`` raises it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzzing import CONTEXT, FUZZ, MAX_NEW, MODEL, VOCAB
from hypothesis import given
from hypothesis import strategies as st

from kvconductor.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc

UINT32 = 2**32 - 1
TIMEOUT_S = 60.0  # detects a hang; never a performance bound
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}

# -- strategies --------------------------------------------------------------------------------------------------

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
TEXT = st.text(max_size=60)  # any code point but surrogates (protobuf strings are UTF-8)
ODD_TEXT = st.text(st.sampled_from("\x00\ufeff\u202e\u0301\U0001f600\U0010ffff\ufffd\n\t a"), max_size=30)
IN_VOCAB = st.integers(min_value=0, max_value=VOCAB - 1)
# max_tokens: small, or rejected for exceeding the context. Never 0 (= up to the context) here, so no example
# generates for long; test_prompts_at_the_context_length covers 0.
MAX_TOKENS = st.one_of(st.integers(min_value=1, max_value=MAX_NEW), st.integers(min_value=CONTEXT, max_value=UINT32))


def sampling() -> st.SearchStrategy[common_pb2.SamplingParams]:
    """Sampling fields, each sometimes odd: negative/NaN/inf temperature, top_p outside (0, 1], huge top_k."""
    fields = {
        "temperature": st.one_of(st.floats(min_value=0.0, max_value=2.0, width=32), FLOAT32),
        "top_p": st.one_of(st.floats(min_value=0.0, max_value=1.0, width=32), FLOAT32),
        "top_k": st.one_of(st.integers(min_value=0, max_value=VOCAB), st.integers(min_value=0, max_value=UINT32)),
        "seed": st.integers(min_value=0, max_value=2**64 - 1),
        "stop_token_ids": st.lists(st.one_of(IN_VOCAB, st.integers(min_value=0, max_value=UINT32)), max_size=5),
        "ignore_eos": st.booleans(),
    }
    return st.builds(
        lambda max_tokens, rest: common_pb2.SamplingParams(max_tokens=max_tokens, **rest),
        MAX_TOKENS,
        st.fixed_dictionaries({}, optional=fields),
    )


def prompt() -> st.SearchStrategy[dict[str, Any]]:
    """No prompt, text (empty, ordinary or odd unicode) or token ids (empty, in or out of the vocabulary)."""
    return st.one_of(
        st.just({}),
        st.builds(lambda t: {"text": t}, st.one_of(TEXT, ODD_TEXT)),
        st.builds(
            lambda ids: {"token_ids": conductor_pb2.TokenIds(ids=ids)},
            st.lists(st.one_of(IN_VOCAB, st.integers(min_value=0, max_value=UINT32)), max_size=40),
        ),
    )


REQUESTS = st.builds(
    lambda p, s, **kw: conductor_pb2.GenerateRequest(**p, sampling=s, **kw),
    prompt(),
    sampling(),
    request_id=st.one_of(st.just(""), TEXT),
    stop=st.lists(st.one_of(st.text(max_size=3), st.text(max_size=200)), max_size=64),
    deployment=st.one_of(st.sampled_from(list(conductor_pb2.Deployment.values())), st.integers(0, 2**31 - 1)),
    model=st.one_of(st.just(""), st.just(MODEL), TEXT, ODD_TEXT),
    include_decision=st.booleans(),
)

# -- checks ------------------------------------------------------------------------------------------------------


def generate(stub: conductor_pb2_grpc.ConductorStub, request: conductor_pb2.GenerateRequest) -> grpc.StatusCode:
    """Run one call to its end; OK only when the last message carries the finish reason and usage."""
    try:
        messages = list(stub.Generate(request, timeout=TIMEOUT_S))
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, f"{e.code().name}: {e.details()} for {request}"
        assert e.details(), request
        return e.code()
    last = messages[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH), messages
    assert last.HasField("usage") and last.usage.completion_tokens == sum(len(m.token_ids) for m in messages)
    limit = request.sampling.max_tokens or CONTEXT
    assert 1 <= last.usage.completion_tokens <= limit, last.usage
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def stub(cluster: Any) -> Iterator[conductor_pb2_grpc.ConductorStub]:
    with grpc.insecure_channel(cluster.conductor) as channel:
        yield conductor_pb2_grpc.ConductorStub(channel)


@pytest.fixture(autouse=True)
def still_serves(stub: conductor_pb2_grpc.ConductorStub) -> Iterator[None]:
    """After each test: a normal request still completes."""
    yield
    request = conductor_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    assert generate(stub, request) == grpc.StatusCode.OK


# -- tests -------------------------------------------------------------------------------------------------------


@FUZZ
@given(request=REQUESTS)
def test_any_generate_request_finishes_or_is_refused(
    stub: conductor_pb2_grpc.ConductorStub, request: conductor_pb2.GenerateRequest
) -> None:
    generate(stub, request)


@FUZZ
@given(
    ids=st.lists(IN_VOCAB, min_size=1, max_size=40),
    max_tokens=st.integers(min_value=1, max_value=MAX_NEW),
    temperature=st.floats(min_value=0.0, max_value=2.0, width=32),
    top_p=st.floats(min_value=0.0, max_value=1.0, width=32),  # 0 = off
    top_k=st.integers(min_value=0, max_value=UINT32),
    deployment=st.sampled_from(list(conductor_pb2.Deployment.values())),
)
def test_valid_requests_finish(
    stub: conductor_pb2_grpc.ConductorStub,
    ids: list[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    deployment: int,
) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    request = conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=ids), sampling=sampling)
    request.deployment = deployment
    assert generate(stub, request) in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf, -1.0])
@pytest.mark.parametrize("deployment", [conductor_pb2.DEPLOYMENT_DISAGGREGATED, conductor_pb2.DEPLOYMENT_COLOCATED])
def test_bad_temperature_is_invalid_argument(
    stub: conductor_pb2_grpc.ConductorStub, temperature: float, deployment: int
) -> None:
    """A temperature that reaches the engine unchecked would sample garbage (NaN) or crash it."""
    request = conductor_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=temperature), deployment=deployment
    )
    assert generate(stub, request) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("top_p", [math.nan, -0.5])
def test_bad_top_p_is_invalid_argument(stub: conductor_pb2_grpc.ConductorStub, top_p: float) -> None:
    request = conductor_pb2.GenerateRequest(
        text="Hello", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=1.0, top_p=top_p)
    )
    assert generate(stub, request) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("length", "max_tokens"), [(CONTEXT - 3, 0), (CONTEXT - 1, 1), (CONTEXT, 1), (CONTEXT, 0)])
def test_prompts_at_the_context_length(stub: conductor_pb2_grpc.ConductorStub, length: int, max_tokens: int) -> None:
    """max_tokens 0 fills the context; a prompt that leaves no room is refused."""
    request = conductor_pb2.GenerateRequest(
        token_ids=conductor_pb2.TokenIds(ids=[97] * length),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    code = generate(stub, request)
    if length < CONTEXT:
        # A long prefill on a slow machine may be refused by the TTFT SLO: RESOURCE_EXHAUSTED, not a failure.
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED)
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_ending_at_token_0_streams_it_once(stub: conductor_pb2_grpc.ConductorStub) -> None:
    request = conductor_pb2.GenerateRequest(
        text="Hello",
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        deployment=conductor_pb2.DEPLOYMENT_DISAGGREGATED,
    )
    messages = list(stub.Generate(request, timeout=TIMEOUT_S))
    assert sum(len(m.token_ids) for m in messages) == 1
    assert messages[-1].usage.completion_tokens == 1
