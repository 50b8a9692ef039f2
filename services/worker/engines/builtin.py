"""The built-in torch engine behind the EnginePort: it owns the engine thread and its thread-safety rules.

The same adapter serves the emulated engine (``[engine] backend = "emulated"``): the built-in engine
whose forward pass is a wait from a latency profile (``engine.emulated_runner``).

Requests, aborts and KV imports run on the engine thread between steps (``EngineLoop.call``); what the
engine guards with its own lock (reserving, pinning, allocating, load, KV events) runs at once on a
worker thread (``EngineLoop.call_now``), so a decode reservation or a KV export never waits for a long
step. ``build`` makes the engine a worker needs: load the model, allocate the pool, profile it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

from engine.block_manager import StoredBlock
from engine.emulated_runner import Emulation
from engine.llm_engine import LLMEngine
from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from scheduler.profiles import named_profile
from services.common.config import Config, WorkerConfig
from services.common.metrics import register_engine
from services.worker.engines.loop import EngineDied, EngineLoop, next_output
from services.worker.engines.port import EngineLoad, ImportedBlocks, KVLayout, RemotePrefill
from services.worker.profiling import cache as profile_cache
from services.worker.profiling.profiler import emulated_profile, profile_engine
from services.worker.profiling.refiner import CostRefiner

log = logging.getLogger(__name__)


class BuiltinEngine:
    """``LLMEngine`` on its own thread, as an ``EnginePort``."""

    moves_kv_itself = False

    def __init__(self, engine: LLMEngine, refiner: CostRefiner | None = None) -> None:
        self._loop = EngineLoop(engine, on_step=refiner.observe if refiner is not None else None)
        pool, model = engine.kv_pool, engine.config
        self.layout = KVLayout(
            block_size=pool.block_size,
            num_blocks=pool.num_blocks,
            bytes_per_block=pool.bytes_per_block,
            base_address=pool.base_address,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=str(pool.data.dtype).removeprefix("torch."),
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
        )

    @property
    def died(self) -> asyncio.Future[BaseException] | None:
        """Resolves when the engine thread dies."""
        return self._loop.died

    def start(self) -> None:
        """Start the engine thread."""
        self._loop.start()

    async def close(self) -> None:
        """Stop the engine thread after its current step."""
        await asyncio.to_thread(self._loop.stop)

    def heartbeat(self) -> tuple[int, float]:
        """(turns of the engine loop, seconds since the last one)."""
        return self._loop.beats, self._loop.heartbeat_age()

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        imported: ImportedBlocks | None = None,
    ) -> AsyncGenerator[StepOutput, None]:
        """Add the request (with a KV copy's blocks, in one engine-thread command) and stream its outputs."""

        def add(e: LLMEngine) -> StepOutput | None:
            if imported is None:
                e.add_request(request_id, prompt, params, prefill_only=prefill_only)
                return None
            pinned = imported.held + _commit(e, imported, keep_reference=True)
            try:  # the request holds the copy's blocks until admitted: a wait in the queue cannot evict them
                e.add_request(request_id, prompt, params, prefill_only=prefill_only, pinned=pinned)
            except BaseException:
                e.unpin_blocks(pinned)
                raise
            return None

        async for out in self._stream(request_id, add):
            yield out

    async def decode(
        self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams
    ) -> AsyncGenerator[StepOutput, None]:
        """Join the batch with token 0 and stream the tokens after it (token 0 ending it: one empty finish)."""
        async for out in self._stream(
            request_id, lambda e: e.add_prefilled_request(request_id, prompt, first_token_id, params)
        ):
            yield out

    async def _stream(
        self, request_id: str, add: Callable[[LLMEngine], StepOutput | None]
    ) -> AsyncGenerator[StepOutput, None]:
        outputs = self._loop.open(request_id)
        finished = False
        try:
            first = await self._loop.call(add)
            if first is not None:  # token 0 ended a prefilled request: nothing new, only the finish
                finished = True
                yield dataclasses.replace(first, new_token_ids=[])
                return
            while not finished:
                out = await next_output(outputs)
                finished = out.finished
                yield out
        finally:
            self._loop.close(request_id)
            if not finished:
                await self.abort(request_id)

    async def release(self, request_id: str) -> None:
        """Free a finished prefill-only request's blocks, without waiting for the engine's next step."""
        with contextlib.suppress(EngineDied):
            await asyncio.shield(self._loop.call_now(lambda e: e.release(request_id)))

    async def abort(self, request_id: str) -> None:
        """Drop a request; completes even if the caller is cancelled meanwhile (a dead engine frees nothing)."""
        with contextlib.suppress(EngineDied):
            await asyncio.shield(self._loop.call(lambda e: e.abort(request_id)))

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        remote: RemotePrefill | None = None,
    ) -> tuple[list[int] | None, int]:
        """Blocks for prompt + max_tokens, now, and the free count after (the transfer engine fills them)."""
        return await self._loop.call_now(
            lambda e: (e.reserve(request_id, num_prompt_tokens, params), e.num_free_blocks)
        )

    async def pin_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Hold cached blocks for a peer (or a copy) to read, now."""
        return await self._loop.call_now(lambda e: e.pin_cached_blocks(block_hashes, token_ids))

    async def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop pins, now."""
        if block_ids:
            await self._loop.call_now(lambda e: e.unpin_blocks(block_ids))

    async def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks for copied KV, now."""
        return await self._loop.call_now(lambda e: e.allocate_blocks(num_blocks))

    async def abandon_import(self, imported: ImportedBlocks) -> None:
        """Cache what was copied, give back the rest (shielded, like ``abort``)."""

        def abandon(e: LLMEngine) -> None:
            _commit(e, imported)
            e.unpin_blocks(imported.held)

        with contextlib.suppress(EngineDied):
            await asyncio.shield(self._loop.call(abandon))

    async def export_prefix(self, export_id: str, token_ids: Sequence[int]) -> None:
        """Not for this engine: peers read its pool with the transfer engine (``pin_cached_blocks``)."""
        raise NotImplementedError("the worker's transfer engine copies this engine's KV")

    async def import_prefix(self, export_id: str, token_ids: Sequence[int], source: RemotePrefill) -> bool:
        """Not for this engine: copies land in ``allocate_blocks``' blocks."""
        raise NotImplementedError("the worker's transfer engine copies this engine's KV")

    def held_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Not for this engine: ``pin_cached_blocks`` holds and counts them."""
        raise NotImplementedError("the worker's transfer engine copies this engine's KV")

    def take_kv_pushes(self) -> list[tuple[int, float]]:
        """None: the worker's transfer engine moves this engine's KV, and times each write itself."""
        return []

    def take_store_loads(self) -> list[tuple[int, float]]:
        """None: the worker reads the Store into this engine's pool itself."""
        return []

    async def pop_kv_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        """Blocks stored and block hashes removed since the last call."""
        return await self._loop.call_now(lambda e: e.pop_kv_events())

    def pop_store_puts(self) -> list[bytes]:
        """None: the worker writes this engine's blocks through to the Store (``prefill._write_through``)."""
        return []

    async def load(self) -> EngineLoad:
        """The engine's load now."""
        if self._loop.failure is not None:
            raise EngineDied(self._loop.failure)
        return await asyncio.to_thread(self.snapshot)

    def snapshot(self) -> EngineLoad:
        """The engine's load, from any thread (the engine guards its counters with its lock)."""
        e = self._loop.engine
        stats = e.stats()
        return EngineLoad(
            stats.num_waiting, stats.num_running, e.num_free_blocks, self.layout.num_blocks,
            stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens,
        )  # fmt: skip

    def inject_fault(self, kind: str) -> None:
        """Test-only faults of the engine thread."""
        self._loop.inject_fault(kind)


def _commit(e: LLMEngine, imported: ImportedBlocks, keep_reference: bool = False) -> list[int]:
    """Engine thread: cache the copied blocks and give back the unfilled targets; the copied blocks.

    ``keep_reference``: the copied blocks stay referenced (the caller hands the references on).
    """
    bs = e.kv_pool.block_size
    first, last = len(imported.held), len(imported.held) + imported.num_copied
    copied = imported.targets[: imported.num_copied]
    if copied:
        parent = imported.block_hashes[first - 1] if first else None
        e.commit_imported_blocks(
            copied, imported.block_hashes[first:last], imported.token_ids[first * bs : last * bs], parent,
            keep_reference=keep_reference,
        )  # fmt: skip
    e.unpin_blocks(imported.targets[imported.num_copied :])
    return copied


def emulation_of(config: Config) -> Emulation:
    """The ``[emulation]`` section as the emulated engine runs it."""
    profile = named_profile(config.emulation.profile)
    return Emulation(
        profile.prefill, profile.decode, time_scale=config.emulation.time_scale,
        kv_bytes_per_token=config.emulation.kv_bytes_per_token, max_model_len=config.emulation.max_model_len,
        link=profile.link if config.emulation.model_link else None, model_bytes_per_token=profile.bytes_per_token,
    )  # fmt: skip


def build(
    config: Config, role: str, pool_config: WorkerConfig, emulation: Emulation | None = None, instance_id: str = ""
) -> tuple[BuiltinEngine, CostRefiner]:
    """Load the model, allocate the paged KV pool and profile it.

    ``emulation`` (``emulation_of(config)`` for the emulated backend): load only the model's config.json and
    run the emulated forward pass; its profile carries ``[emulation] profile_error``, seeded by ``instance_id``.
    """
    log.info("loading %s (%s) with a %d MiB KV pool%s", config.model.path, config.model.dtype,
             pool_config.kv_cache_memory_mb, "" if emulation is None else f", emulated: {emulation}")  # fmt: skip
    engine = LLMEngine(
        config.model.path,
        kv_cache_bytes=pool_config.kv_cache_bytes,
        block_size=config.block_size,
        max_num_batched_tokens=pool_config.max_num_batched_tokens,
        max_num_seqs=pool_config.max_concurrent_requests,
        # Prefill workers run prompts one at a time, first come first served: TTFT is then T_queue + T_prefill,
        # as the Conductor predicts it. Colocated workers pack prompts as vLLM does (the baseline).
        max_num_prefills=1 if role == "prefill" else None,
        kv_cache_dtype=pool_config.kv_cache_dtype,
        enable_prefix_caching=pool_config.enable_prefix_caching and role != "decode",
        dtype=config.model.dtype,
        emulation=emulation,
    )
    if emulation is not None:
        e = config.emulation  # computed, not timed: nothing to keep
        refiner = emulated_profile(emulation, e.profile_error, f"{e.profile_error_seed}/{instance_id}")
    else:
        key = profile_cache.fingerprint(config, role, pool_config)
        refiner = profile_cache.load(config, key) or profile_engine(engine)
        profile_cache.save(config, key, refiner)
    engine.pop_kv_events()  # the profile's blocks are not worth announcing,
    engine.reset_prefix_cache_stats()  # nor its lookups counting in the hit rate
    port = BuiltinEngine(engine, refiner)
    register_engine(port.snapshot)
    return port, refiner
