"""End to end: a real cluster from `kvconductor up` (etcd, kvmeta, Conductor, workers, gateway)."""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import helpers
import httpx
import openai
import pytest

from engine.block_hash import prefix_block_hashes
from engine.tokenizer import load_tokenizer
from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc

PROMPT_LENGTHS = (1, 5, 15, 16, 17, 40, 64, 130, 257, 480)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """Greedy tokens of the same engine run in this process, no cluster."""
    return helpers.reference_tokens(model_dir, prompts)


def test_streaming_chat_completion_with_the_openai_client(cluster):
    client = openai.OpenAI(base_url=cluster.rest, api_key="unused")
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens > 3
    explained = helpers.cli(cluster, "explain", chunks[0].id)  # the response's id names the request too
    assert explained.returncode == 0 and chunks[0].id.removeprefix("chatcmpl-") in explained.stdout


def test_every_port_of_every_process_stays_on_the_cluster_host(cluster):
    """[cluster] host is 127.0.0.1: no process (Mooncake's transfer engines included) listens anywhere else."""
    assert helpers.listeners_off(cluster) == []
    assert len(cluster.manifest["processes"]) >= 6  # the Conductor, kvmeta, the gateway and four workers were seen


def test_disaggregated_output_equals_in_process_and_colocated(cluster, prompts, reference):
    before = helpers.worker_loads(cluster)
    for prompt, expected in zip(prompts, reference, strict=True):
        disaggregated, decision, _ = helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED)
        assert decision.prefill_instance.startswith("prefill-")
        assert decision.decode_instance == "decode-0"
        colocated, decision, _ = helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_COLOCATED)
        assert decision.prefill_instance == "colocated-0"
        assert disaggregated == expected, f"prompt of {len(prompt)} tokens"
        assert colocated == expected, f"prompt of {len(prompt)} tokens"
    after = helpers.worker_loads(cluster)
    # Every prompt block, the last partial one included, crossed the transfer engine exactly once.
    bytes_per_block = helpers.bytes_per_block(cluster)
    blocks = sum(math.ceil(len(p) / 16) for p in prompts)
    sent = sum(after[i].kv_bytes_sent - before[i].kv_bytes_sent for i in ("prefill-0", "prefill-1"))
    blocks_sent = sum(after[i].kv_blocks_sent - before[i].kv_blocks_sent for i in ("prefill-0", "prefill-1"))
    received = after["decode-0"].kv_bytes_received - before["decode-0"].kv_bytes_received
    assert blocks_sent == blocks
    assert sent == received == blocks * bytes_per_block


def test_shared_prefix_is_reused(cluster):
    rng = random.Random(11)
    prefix = [rng.randrange(256) for _ in range(320)]
    _, first, usage = helpers.grpc_generate(cluster, prefix + [1, 2, 3], conductor_pb2.DEPLOYMENT_DISAGGREGATED)
    assert usage.cached_tokens == 0
    holders = {first.prefill_instance}
    for suffix in ([4, 5, 6, 7], [8, 9]):
        _, decision, usage = helpers.grpc_generate(cluster, prefix + suffix, conductor_pb2.DEPLOYMENT_DISAGGREGATED)
        assert usage.cached_tokens == 320
        assert decision.prefix_len == 320
        # Either a holder computes the rest, or another instance copies the prefix from one first.
        assert decision.copy_from in holders if decision.copy_from else decision.prefill_instance in holders
        holders.add(decision.prefill_instance)
    # Through REST the reuse shows in usage.prompt_tokens_details.cached_tokens.
    client = openai.OpenAI(base_url=cluster.rest, api_key="unused")
    reply = client.completions.create(model="tiny-llama", prompt=prefix + [9, 9], max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens == 320


def test_prefix_of_a_busy_holder_is_copied_to_another_worker(cluster, model_dir):
    """Hot-spot replication: the holder is busy, so another prefill worker pulls the prefix's KV from it."""
    rng = random.Random(23)
    prefix = [rng.randrange(256) for _ in range(480)]
    _, first, _ = helpers.grpc_generate(cluster, prefix + [1], conductor_pb2.DEPLOYMENT_DISAGGREGATED)
    holder = first.prefill_instance
    long_prompt = prefix + [rng.randrange(256) for _ in range(1500)]
    prompt = prefix + [7, 7, 7]
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(helpers.grpc_generate, cluster, long_prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED)
        time.sleep(0.15)  # the long request is on its way
        tokens, decision, usage = helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED)
        long_decision = busy.result()[1]
    copied = [d for d in (long_decision, decision) if d.copy_from == holder]
    assert copied, f"no copy: long request {long_decision.reason!r}; short request {decision.reason!r}"
    assert copied[-1].prefill_instance != holder
    assert usage.cached_tokens == 480
    # The copied blocks are indexed under both instances now.
    matches = helpers.kvmeta_matches(cluster, prefix_block_hashes(prefix, 16))
    assert matches[holder] == 30 and matches[copied[-1].prefill_instance] == 30
    # And the copy changed nothing in the output.
    from engine.llm_engine import LLMEngine, generate
    from engine.sampling import SamplingParams

    engine = LLMEngine(model_dir, num_blocks=64)
    expected = generate(engine, prompt, SamplingParams(max_tokens=helpers.MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert tokens == expected


def test_rest_text_matches_the_tokens(cluster, model_dir):
    tokenizer = load_tokenizer(model_dir)
    prompt = "The quick brown fox"
    tokens, _, _ = helpers.grpc_generate(cluster, tokenizer.encode(prompt, add_special_tokens=False).ids,
                                 conductor_pb2.DEPLOYMENT_DISAGGREGATED)  # fmt: skip
    client = openai.OpenAI(base_url=cluster.rest, api_key="unused")
    reply = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=helpers.MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert reply.usage.completion_tokens == helpers.MAX_TOKENS


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny-llama", "messages": []}, 400, "messages"),
        (
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
        ),
        (
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
            400,
            "max_tokens",
        ),
        ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, None),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 5000}]}, 400, None),
        # bounds on what a client controls (issue 27): each names the key that sets it
        (
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 100_000},
            400,
            "max_stop_strings",
        ),
        (
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stop": ["s" * 300]},
            400,
            "max_stop_bytes",
        ),
        (
            {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stop_token_ids": [1] * 100},
            400,
            "max_stop_token_ids",
        ),
        ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}] * 5000}, 400, "messages"),
        ({"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(cluster, body, status, param):
    response = httpx.post(f"{cluster.rest}/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert param in (error["param"] or "") or param in error["message"]


def test_malformed_json_is_a_400(cluster):
    response = httpx.post(f"{cluster.rest}/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400
    assert "error" in response.json()


def test_openai_client_sees_typed_errors(cluster):
    client = openai.OpenAI(base_url=cluster.rest, api_key="unused")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=100000)


def test_grpc_errors_have_status_codes(cluster):
    with grpc.insecure_channel(cluster.conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        with pytest.raises(grpc.RpcError) as empty:
            list(stub.Generate(conductor_pb2.GenerateRequest(), timeout=30))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as vocab:
            list(
                stub.Generate(conductor_pb2.GenerateRequest(token_ids=conductor_pb2.TokenIds(ids=[10**6])), timeout=30)
            )
        assert vocab.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vocabulary" in vocab.value.details()
        with pytest.raises(grpc.RpcError) as resumed:  # a failed-over request's tokens are checked the same way
            resume = conductor_pb2.GenerateRequest(text="hi", resume_token_ids=[1, 10**6])
            list(stub.Generate(resume, timeout=30))
        assert resumed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token id 1000000 is outside the vocabulary" in resumed.value.details()


def test_two_clients_sending_the_same_request_id_each_get_their_own_output(cluster, prompts, reference, model_dir):
    """The client's id is a label: two requests with one id run side by side without touching each other's KV."""
    pairs = list(zip(prompts[-4:], reference[-4:], strict=True))

    def rest(prompt):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": helpers.MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{cluster.rest}/completions", json=body, headers={"x-request-id": "same"}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"] == "same"
        return reply.json()

    def grpc_call(prompt):
        return helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_AUTO, request_id="same")[0]

    with ThreadPoolExecutor(len(pairs) * 2) as pool:
        replies = list(pool.map(rest, [p for p, _ in pairs]))
        tokens = list(pool.map(grpc_call, [p for p, _ in pairs]))
    tokenizer = load_tokenizer(model_dir)
    assert tokens == [expected for _, expected in pairs]
    texts = [tokenizer.decode(expected, skip_special_tokens=True) for _, expected in pairs]
    assert [r["choices"][0]["text"] for r in replies] == texts
    assert len({r["id"] for r in replies}) == len(replies)  # every response has an id of its own
    assert helpers.cli(cluster, "explain", replies[0]["id"]).returncode == 0  # the response id finds its decision


def test_a_long_text_prompt_is_bounded_and_tokenized_off_the_loop(cluster):
    """A prompt over [scheduler] max_prompt_bytes is refused before tokenizing, naming the key."""
    with grpc.insecure_channel(cluster.conductor) as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        with pytest.raises(grpc.RpcError) as big:
            list(stub.Generate(conductor_pb2.GenerateRequest(text="x" * ((1 << 20) + 1)), timeout=30))
        assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_bytes" in big.value.details()
        with pytest.raises(grpc.RpcError) as label:
            list(stub.Generate(conductor_pb2.GenerateRequest(request_id="r" * 1000, text="hi"), timeout=30))
        assert label.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_request_id_bytes" in label.value.details()


def test_explain_and_status_commands(cluster):
    prompt = list(range(40, 140))
    helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED, request_id="explain-me")
    explained = helpers.cli(cluster, "explain", "explain-me")
    assert explained.returncode == 0, explained.stderr
    assert "request explain-me [" in explained.stdout  # the client's label, then the Conductor's id
    assert "] (kvcache_centric): prefill prefill-" in explained.stdout
    assert "prefill-0" in explained.stdout and "prefill-1" in explained.stdout  # every candidate is listed
    assert "T_queue" in explained.stdout and "TTFT" in explained.stdout
    assert helpers.cli(cluster, "explain", "never-sent").returncode == 1
    status = helpers.cli(cluster, "status")
    assert status.returncode == 0, status.stderr
    for instance in ("prefill-0", "prefill-1", "decode-0", "colocated-0"):
        assert instance in status.stdout
    assert "cost-model median relative error: ttft" in status.stdout
    assert "requests finished in the last 300 s" in status.stdout and "TTFT (n=" in status.stdout
    assert "ok" in status.stdout and "learned TTFT overhead" in status.stdout
    assert "KV index: following kvmeta at 127.0.0.1:" in status.stdout and "indexed" in status.stdout
    assert "ms/1k tokens" in status.stdout and "ms/sequence" in status.stdout  # cost models with their units


def test_long_prompt_streams_its_kv_during_prefill(cluster, model_dir):
    """A prompt of two prefill chunks: the first chunk's KV crosses while the second computes."""
    rng = random.Random(31)
    prompt = [rng.randrange(256) for _ in range(3000)]  # chunks of 2048 + 952 tokens
    tokens, _, _ = helpers.grpc_generate(cluster, prompt, conductor_pb2.DEPLOYMENT_DISAGGREGATED, request_id="long-1")
    with grpc.insecure_channel(cluster.conductor) as channel:
        decision = conductor_pb2_grpc.ConductorStub(channel).ExplainDecision(
            conductor_pb2.ExplainDecisionRequest(request_id="long-1"), timeout=10
        )
    outcome = decision.outcome
    assert outcome.kv_send_ms > 0 and outcome.ttft_ms > 0
    assert outcome.kv_send_exposed_ms < outcome.kv_send_ms  # part of the transfer overlapped compute
    from engine.llm_engine import LLMEngine, generate
    from engine.sampling import SamplingParams

    engine = LLMEngine(model_dir, num_blocks=256)
    expected = generate(engine, prompt, SamplingParams(max_tokens=helpers.MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert tokens == expected


def test_python_client_and_generate_cluster_command(cluster):
    from cli.client import ConductorClient

    with ConductorClient(cluster.conductor) as client:
        result = client.complete(list(range(10, 60)), max_tokens=5, ignore_eos=True, include_decision=True)
        assert len(result.token_ids) == 5 and result.finish_reason == "length"
        assert result.usage.prompt_tokens == 50 and result.decision.prefill_instance.startswith("prefill-")
        assert client.explain(result.request_id).request_id == result.conductor_request_id == result.request_id
        with pytest.raises(grpc.RpcError) as missing:
            client.explain("no-such-request")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    out = helpers.cli(cluster, "generate", "--cluster", "--prompt", "hello there", "--max-tokens", "4", "--json")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["usage"]["completion_tokens"] <= 4 and reply["prefill_instance"].startswith("prefill-")


def test_colocated_worker_serves_the_openai_api_itself(cluster):
    """What third-party routers need from a worker: health, models, streaming completions, tokenize, load."""
    from services.common.registry import Registry

    with Registry(cluster.manifest["etcd"], cluster.manifest["cluster"]) as registry:
        url = registry.list("colocated")[("colocated", "colocated-0")].openai_url
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    router_fields = {"skip_special_tokens": True, "no_stop_trim": False, "return_hidden_states": False}
    stream = client.completions.create(
        model="tiny-llama",
        prompt="Hello worker",
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True, **router_fields},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    tokenized = httpx.post(f"{url}/tokenize", json={"model": "tiny-llama", "prompt": "Hello"}, timeout=10).json()
    assert tokenized == {"count": 5, "max_model_len": 4096, "tokens": list(b"Hello")}
    assert httpx.get(f"{url}/get_load", timeout=10).json()["load"] == 0


def test_async_openai_client_streaming_and_not(cluster):
    import asyncio

    async def both():
        async with openai.AsyncOpenAI(base_url=cluster.rest, api_key="unused") as client:
            messages = [{"role": "user", "content": "Hello again"}]
            options = {"model": "tiny-llama", "messages": messages, "max_tokens": 5, "temperature": 0}
            whole = await client.chat.completions.create(**options, extra_body={"ignore_eos": True})
            stream = await client.chat.completions.create(**options, stream=True, extra_body={"ignore_eos": True})
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole, text

    whole, streamed = asyncio.run(both())
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.content == streamed  # greedy: the same text either way


def test_gateway_health_is_ready_only_once_a_worker_can_serve(cluster, tmp_path):
    """A Conductor and a gateway of a second, empty cluster on the same etcd: 503 until a worker joins."""
    from services.common.net import free_port

    conductor = f"127.0.0.1:{free_port()}"
    gateway_port = free_port()
    extra = ["--set", 'cluster.name="empty"', "--set", f'cluster.scheduler_endpoint="{conductor}"',
             "--set", f"gateway.port={gateway_port}"]  # fmt: skip
    processes = [helpers.spawn(cluster, role, f"{role}-0", tmp_path, extra) for role in ("conductor", "gateway")]
    try:
        url = f"http://127.0.0.1:{gateway_port}/health"

        def status():
            try:
                return httpx.get(url, timeout=5).status_code
            except httpx.HTTPError:
                return None

        deadline = time.monotonic() + 60
        while status() is None:  # the gateway starts
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # several of the Conductor's liveness polls
        assert status() == 503  # both up, no worker: not ready
        processes.append(helpers.spawn(cluster, "colocated", "colocated-0", tmp_path, extra))
        deadline = time.monotonic() + 120
        while status() != 200:
            assert time.monotonic() < deadline, "the gateway never became ready after a worker joined"
            time.sleep(0.2)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def test_tokenize_takes_chat_messages_as_a_chat_request_renders_them(cluster, model_dir):
    from services.gateway.chat_template import ChatTemplate

    url = cluster.rest.removesuffix("/v1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = httpx.post(f"{url}/tokenize", json={"model": "tiny-llama", "messages": messages}, timeout=10).json()
    prompt = ChatTemplate(model_dir).render(messages)
    assert got["tokens"] == load_tokenizer(str(model_dir)).encode(prompt, add_special_tokens=False).ids
    for neither_or_both in ({"model": "tiny-llama"}, {"prompt": "x", "messages": messages}):
        refused = httpx.post(f"{url}/tokenize", json=neither_or_both, timeout=10)
        assert refused.status_code == 400 and "either prompt or messages" in refused.json()["error"]["message"]
