"""The vLLM adapter's decode side: a token 0 that is not the prefill's fails its attempt (INTERNAL, so the Conductor
resumes it); a reservation commits real pool blocks and is refused when they are short."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from services.common import metrics
from services.common.rpc import RpcError
from services.worker.engines.port import KVLayout
from services.worker.engines.vllm_engine import VllmEngine


class _Llm:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _engine() -> tuple[VllmEngine, _Llm]:
    layout = KVLayout(block_size=16, num_blocks=8, bytes_per_block=1024, base_address=0, num_layers=1,
                      num_kv_heads=1, head_dim=8, dtype="float32", max_model_len=256, vocab_size=256)  # fmt: skip
    llm = _Llm()
    return VllmEngine(llm, layout, "decode"), llm


async def _waiting(engine: VllmEngine, request_id: str, outputs: list[StepOutput]) -> None:
    """A decode request parked in the adapter whose vLLM stream yields ``outputs``."""
    queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
    for out in outputs:
        queue.put_nowait(out)
    engine._remote[request_id] = (queue, asyncio.create_task(asyncio.sleep(3600)))


async def _decode(engine: VllmEngine, request_id: str, first_token_id: int) -> list[int]:
    tokens = []
    async for out in engine.decode(request_id, [1, 2, 3], first_token_id, SamplingParams(max_tokens=3)):
        tokens += out.new_token_ids
    return tokens


async def test_the_same_token_0_is_dropped_and_the_rest_streams():
    engine, _ = _engine()
    await _waiting(engine, "r", [StepOutput("r", [7, 8], False, None, 0), StepOutput("r", [9], True, "length", 0)])
    assert await _decode(engine, "r", 7) == [8, 9]


async def test_another_token_0_fails_the_attempt_counts_it_and_aborts_the_request():
    engine, llm = _engine()
    before = metrics.DIVERGENCES._value.get()
    await _waiting(engine, "r", [StepOutput("r", [5, 8], False, None, 0), StepOutput("r", [9], True, "length", 0)])
    with pytest.raises(RpcError) as failed:
        await _decode(engine, "r", 7)
    assert failed.value.code == grpc.StatusCode.INTERNAL and "token 0 = 5 here, 7 on the prefill worker" in str(
        failed.value
    )
    assert metrics.DIVERGENCES._value.get() == before + 1
    assert llm.aborted == ["r"] and "r" not in engine._remote  # nothing of it stays in vLLM or the adapter


async def test_a_reservation_beyond_the_free_blocks_is_refused_and_a_finished_one_gives_them_back(monkeypatch):
    from services.worker.engines.port import RemotePrefill

    engine, llm = _engine()  # 8 blocks of 16 tokens
    submitted = []

    async def stream(request_id, prompt, sampling):  # vLLM parks the request until its KV arrives
        submitted.append(request_id)
        await asyncio.sleep(3600)
        yield

    monkeypatch.setattr(engine, "_stream", stream)
    monkeypatch.setattr(engine, "_sampling", lambda params, transfer, prefill=False: None)
    remote = RemotePrefill("p0", "127.0.0.1:1")

    async def reserve(request_id, prompt_tokens, max_tokens):
        return await engine.reserve(request_id, prompt_tokens, SamplingParams(max_tokens=max_tokens),
                                    list(range(prompt_tokens)), remote)  # fmt: skip

    assert await reserve("a", 40, 24) == ([], 4)  # 64 tokens: 4 of the 8 blocks committed
    assert await reserve("b", 40, 40) == (None, 4)  # 5 blocks > 4 free: refused, never submitted
    assert await reserve("c", 20, 20) == ([], 1)  # 3 blocks
    assert engine.snapshot().num_free_blocks == 1  # what the Conductor's decode choice sees
    await asyncio.sleep(0)
    assert submitted == ["a", "c"]
    engine.stats.kv_cache_usage = 0.75  # vLLM's last step: 6 blocks in use (prompts and outputs so far)
    assert await reserve("d", 17, 15) == (None, 1)  # 2 blocks: a and c still hold what they may grow into
    await engine.abort("a")  # released, or its decode ended
    assert "a" in llm.aborted and engine.num_free_blocks == 2  # the pool's own count is the fewer now
    assert await reserve("d", 17, 15) == ([], 2)  # until vLLM's next step frees a's blocks, still the pool's 2


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
