"""The vLLM adapter's decode side: a request continues the prefill's token 0, or samples it again and one that is
not the prefill's fails its attempt (INTERNAL, so the Conductor resumes it); a reservation commits real pool blocks
and is refused when they are short."""

from __future__ import annotations

import grpc
import pytest

from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from services.common import metrics
from services.common.rpc import RpcError
from services.worker.engines.port import KVLayout
from services.worker.engines.vllm_engine import VllmEngine, continues_token_0

AGAIN = list(range(1, 17))  # a prompt filling its last block: token 0's slot would start a block, sampled again


class _Llm:
    errored = False

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _engine(eos_token_ids: frozenset[int] | None = frozenset({2})) -> tuple[VllmEngine, _Llm]:
    layout = KVLayout(block_size=16, num_blocks=8, bytes_per_block=1024, base_address=0, num_layers=1,
                      num_kv_heads=1, head_dim=8, dtype="float32", max_model_len=256, vocab_size=256)  # fmt: skip
    llm = _Llm()
    return VllmEngine(llm, layout, "decode", eos_token_ids=eos_token_ids), llm


def _reserved(engine: VllmEngine, monkeypatch, outputs: list[StepOutput], what: list | None = None) -> list[str]:
    """vLLM's stream of every decode request yields ``outputs``; the requests submitted to it, in order.

    ``what``: gets (prompt, max_tokens) of each.
    """
    submitted: list[str] = []

    async def stream(request_id, prompt, params):
        submitted.append(request_id)
        if what is not None:
            what.append((prompt, params.max_tokens))
        finished = False
        try:
            for out in outputs:
                finished = out.finished
                yield out
        finally:  # as vLLM's: a stream closed before its end aborts the request
            if not finished:
                await engine.abort(request_id)

    monkeypatch.setattr(engine, "_stream", stream)
    monkeypatch.setattr(engine, "_sampling", lambda params, transfer, prefill=False: params)
    return submitted


async def _reserve(engine: VllmEngine, request_id: str, prompt_tokens: int, max_tokens: int):
    from services.worker.engines.port import RemotePrefill

    return await engine.reserve(request_id, prompt_tokens, SamplingParams(max_tokens=max_tokens),
                                RemotePrefill("p0", "127.0.0.1:1"))  # fmt: skip


async def _decode(engine: VllmEngine, request_id: str, first_token_id: int, prompt: list[int] = AGAIN) -> list[int]:
    tokens = []
    async for out in engine.decode(request_id, prompt, first_token_id, SamplingParams(max_tokens=3)):
        tokens += out.new_token_ids
    return tokens


async def test_the_request_continues_token_0_where_its_slot_lies_inside_the_last_prompt_block(monkeypatch):
    engine, _ = _engine()
    what: list = []
    outputs = [StepOutput("r", [8], False, None, 0), StepOutput("r", [9], True, "length", 0)]
    submitted = _reserved(engine, monkeypatch, outputs, what)
    assert await _reserve(engine, "r", 3, 3) == ([], 7)
    assert submitted == []  # vLLM gets the request when its prefill is done, not while it waits for it
    assert await _decode(engine, "r", 7, [1, 2, 3]) == [8, 9]  # token 1 is vLLM's first: nothing dropped
    assert what == [([1, 2, 3, 7], 2)] and engine.num_free_blocks == 8  # its blocks given back as it ended


async def test_the_same_token_0_sampled_again_is_dropped_and_the_rest_streams(monkeypatch):
    engine, _ = _engine()
    outputs = [StepOutput("r", [7, 8], False, None, 0), StepOutput("r", [9], True, "length", 0)]
    what: list = []
    submitted = _reserved(engine, monkeypatch, outputs, what)
    assert await _reserve(engine, "r", 16, 3) == ([], 6)
    assert await _decode(engine, "r", 7) == [8, 9]
    assert submitted == ["r"] and what == [(AGAIN, 3)] and engine.num_free_blocks == 8


def test_token_0_is_continued_only_where_the_pull_and_the_stops_allow():
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    eos = frozenset({2})
    assert continues_token_0(17, 5, greedy, 16, eos) and continues_token_0(30, 5, greedy, 16, eos)
    assert not continues_token_0(32, 5, greedy, 16, eos)  # its slot would start a block the prefill lacks
    assert not continues_token_0(31, 5, greedy, 16, eos)  # its slot would fill the block vLLM caches at once
    assert not continues_token_0(17, 2, greedy, 16, eos)  # end of sequence: the request ends at token 0
    assert continues_token_0(17, 2, SamplingParams(max_tokens=8, ignore_eos=True), 16, eos)
    assert not continues_token_0(17, 5, greedy, 16, None)  # the model's end tokens unknown
    assert not continues_token_0(17, 5, SamplingParams(max_tokens=8, stop_token_ids=(5,)), 16, eos)
    assert not continues_token_0(17, 5, SamplingParams(max_tokens=1), 16, eos)
    assert not continues_token_0(17, 5, SamplingParams(max_tokens=8, seed=3), 16, eos)  # draws token 0 first
    assert continues_token_0(17, 5, SamplingParams(max_tokens=8, seed=3, temperature=0.0), 16, eos)


async def test_another_token_0_fails_the_attempt_counts_it_and_aborts_the_request(monkeypatch):
    engine, llm = _engine()
    before = metrics.DIVERGENCES._value.get()
    _reserved(engine, monkeypatch, [StepOutput("r", [5, 8], False, None, 0), StepOutput("r", [9], True, "length", 0)])
    await _reserve(engine, "r", 3, 3)
    with pytest.raises(RpcError) as failed:
        await _decode(engine, "r", 7)
    assert failed.value.code == grpc.StatusCode.INTERNAL and "token 0 = 5 here, 7 on the prefill worker" in str(
        failed.value
    )
    assert metrics.DIVERGENCES._value.get() == before + 1
    assert llm.aborted == ["r"] and "r" not in engine._reserved  # nothing of it stays in vLLM or the adapter
    assert engine.num_free_blocks == 8


async def test_a_reservation_beyond_the_free_blocks_is_refused_and_a_finished_one_gives_them_back(monkeypatch):
    engine, llm = _engine()  # 8 blocks of 16 tokens
    submitted = _reserved(engine, monkeypatch, [StepOutput("a", [1], True, "length", 0)])
    assert await _reserve(engine, "a", 40, 24) == ([], 4)  # 64 tokens: 4 of the 8 blocks committed
    assert await _reserve(engine, "b", 40, 40) == (None, 4)  # 5 blocks > 4 free: refused
    assert await _reserve(engine, "c", 20, 20) == ([], 1)  # 3 blocks
    assert engine.snapshot().num_free_blocks == 1  # what the Conductor's decode choice sees
    engine.stats.kv_cache_usage = 0.75  # vLLM's last step: 6 blocks in use (prompts and outputs so far)
    assert await _reserve(engine, "d", 17, 15) == (None, 1)  # 2 blocks: a and c still hold what they may grow into
    await engine.abort("a")  # released before its decode came
    assert "a" in llm.aborted and engine.num_free_blocks == 2  # the pool's own count is the fewer now
    assert await _reserve(engine, "d", 17, 15) == ([], 2)  # until vLLM's next step frees a's blocks, still the pool's 2
    with pytest.raises(ValueError, match="no decode request 'a' reserved"):
        await _decode(engine, "a", 1)
    assert submitted == []


def _step(bytes_transferred=(), transfer_duration=()):
    """A ``SchedulerStats`` as the stat logger passes it: one step, with the connector's timed pushes."""
    from types import SimpleNamespace

    connector = {"bytes_transferred": list(bytes_transferred), "transfer_duration": list(transfer_duration)}
    return SimpleNamespace(num_waiting_reqs=0, num_running_reqs=1, kv_cache_usage=0.1, kv_connector_stats=connector,
                           prefix_cache_stats=SimpleNamespace(queries=0, hits=0), iteration_details=None)  # fmt: skip


def test_the_connectors_timed_pushes_go_out_with_the_next_prefill_reply_once():
    sent: list[tuple[int, int]] = []
    layout = KVLayout(block_size=16, num_blocks=8, bytes_per_block=1024, base_address=0, num_layers=1,
                      num_kv_heads=1, head_dim=8, dtype="float32", max_model_len=256, vocab_size=256)  # fmt: skip
    engine = VllmEngine(_Llm(), layout, "prefill", count_sent=lambda blocks, n: sent.append((blocks, n)))
    engine.observe_step(_step((4096, 2048), (0.004, 0.002)))
    engine.observe_step(_step())
    engine.observe_step(_step((1024,), (0.001,)))
    assert engine.take_kv_pushes() == [(4096, 0.004), (2048, 0.002), (1024, 0.001)]
    assert engine.take_kv_pushes() == []  # each push is reported once
    assert sent == [(6, 6144), (1, 1024)]  # and counted as bytes sent, as before


async def test_a_request_vllm_ends_with_an_error_fails_its_attempt_instead_of_ending_the_stream():
    """vLLM ends a decode whose KV did not load (its connector's send failed) with the ``error`` finish: the client
    must not get a cut answer as if it had finished; the attempt fails (retryable) and the Conductor resumes it."""
    from types import SimpleNamespace

    engine, llm = _engine()

    async def generate(prompt, sampling, request_id, priority=0):
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], finish_reason="error", logprobs=None)],
                              finished=True, num_cached_tokens=0)  # fmt: skip

    llm.generate = generate
    before = metrics.ENGINE_ERRORS._value.get()
    await _reserve(engine, "r", 3, 3)
    with pytest.raises(RpcError) as failed:
        await _decode(engine, "r", 7)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "did not load" in str(failed.value)
    assert metrics.ENGINE_ERRORS._value.get() == before + 1
    assert "r" not in engine._reserved and engine.num_free_blocks == 8
