"""An EnginePort in memory, for fast in-process tests of the worker services.

Block accounting is real (allocate, hold, free, reserve); the model is not: each step emits the next
token ``(last + 1) % vocab_size`` for every running request, and a prompt's prefill takes one step.
``step_s`` paces the steps; ``gate`` (an asyncio.Event) can hold every step, like a frozen engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from engine.block_manager import StoredBlock
from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from services.worker.engines.port import EngineLoad, ImportedBlocks, KVLayout, RemotePrefill


class FakeEngine:
    """Implements services.worker.engines.port.EnginePort."""

    moves_kv_itself = False

    def __init__(self, num_blocks: int = 64, block_size: int = 16, step_s: float = 0.001) -> None:
        self.layout = KVLayout(
            block_size=block_size, num_blocks=num_blocks, bytes_per_block=1024, base_address=1 << 20, num_layers=1,
            num_kv_heads=1, head_dim=8, dtype="float32", max_model_len=4096, vocab_size=256,
        )  # fmt: skip
        self.step_s = step_s
        self.gate = asyncio.Event()
        self.gate.set()
        self.free = list(range(num_blocks))
        self.owned: dict[str, list[int]] = {}  # request id -> blocks (running, held or reserved)
        self.beats = 0
        self._died: asyncio.Future[BaseException] | None = None

    @property
    def died(self) -> asyncio.Future[BaseException] | None:
        return self._died

    def start(self) -> None:
        self._died = asyncio.get_running_loop().create_future()

    async def close(self) -> None:
        pass

    def heartbeat(self) -> tuple[int, float]:
        return self.beats, 0.0

    def _allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        n = self.layout.num_blocks_for(num_tokens)
        if n > len(self.free):
            return None
        blocks, self.free = self.free[:n], self.free[n:]
        self.owned[request_id] = blocks
        return blocks

    async def _step(self) -> None:
        await self.gate.wait()
        await asyncio.sleep(self.step_s)
        self.beats += 1

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, prefill_only: bool = False,
        imported: ImportedBlocks | None = None,
    ) -> AsyncGenerator[StepOutput, None]:  # fmt: skip
        if imported is not None:
            await self.abandon_import(imported)
        if self._allocate(request_id, len(prompt) + (1 if prefill_only else params.max_tokens)) is None:
            raise ValueError("no free blocks")
        async for out in self._run(request_id, prompt[-1], 1 if prefill_only else params.max_tokens, prefill_only):
            yield out

    async def decode(
        self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams
    ) -> AsyncGenerator[StepOutput, None]:
        if request_id not in self.owned:
            raise ValueError(f"request {request_id!r} has no reservation")
        async for out in self._run(request_id, first_token_id, params.max_tokens - 1, False):
            yield out

    async def _run(self, request_id: str, last: int, count: int, hold: bool) -> AsyncGenerator[StepOutput, None]:
        finished = False
        try:
            for i in range(count):
                await self._step()
                last = (last + 1) % self.layout.vocab_size
                finished = i == count - 1
                blocks = self.owned[request_id] if hold and finished else []
                yield StepOutput(request_id, [last], finished, "length" if finished and not hold else None, 0, blocks)
            if count == 0:
                finished = True
                yield StepOutput(request_id, [], True, "length", 0)
        finally:
            if not finished or not hold:
                await self.abort(request_id)

    async def release(self, request_id: str) -> None:
        await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.free += self.owned.pop(request_id, [])

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        remote: RemotePrefill | None = None,
    ) -> tuple[list[int] | None, int]:
        await asyncio.sleep(0)  # a real engine answers from another thread
        return self._allocate(request_id, num_prompt_tokens + params.max_tokens), len(self.free)

    async def pin_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        return []

    async def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        self.free += list(block_ids)

    async def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self.free):
            return None
        blocks, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return blocks

    async def abandon_import(self, imported: ImportedBlocks) -> None:
        self.free += imported.held + imported.targets

    async def pop_kv_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        return [], []

    def pop_store_puts(self) -> list[bytes]:
        return []

    async def load(self) -> EngineLoad:
        return EngineLoad(0, len(self.owned), len(self.free), self.layout.num_blocks, 0, 0)

    def inject_fault(self, kind: str) -> None:
        with contextlib.suppress(ValueError):
            {"freeze": self.gate.clear, "thaw": self.gate.set}[kind]()
