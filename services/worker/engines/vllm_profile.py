"""The start-up profile of a vLLM worker: the same shapes as the built-in engine's, timed through AsyncLLM.

A prefill shape is the time from submitting a ``max_tokens=1`` request to its token (its cached part
prefilled first, so vLLM's prefix cache serves it); a decode shape is the fastest gap between two tokens
of a batch of requests once all of them decode. Workers on one host take turns (the profiler's lock).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import random
import time
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams
from scheduler.cost_model import attention_work
from services.worker.profiling.profiler import DECODE_SHAPES, DECODE_STEPS, LOCK_PATH, PREFILL_SHAPES, REPEATS
from services.worker.profiling.refiner import CostRefiner

if TYPE_CHECKING:
    from services.worker.engines.vllm_engine import VllmEngine

log = logging.getLogger(__name__)


async def _run(engine: VllmEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[float]:
    """Run a request to the end; the arrival time of each output."""
    times = []
    async for _ in engine.generate(rid, prompt, params):
        times.append(time.perf_counter())
    return times


async def _prefill_samples(engine: VllmEngine, rng: random.Random) -> list[tuple[int, float, float]]:
    vocab, one = engine.layout.vocab_size, SamplingParams(max_tokens=1, temperature=0)
    samples = []
    for i, (new, cached) in enumerate(PREFILL_SHAPES):
        fastest = math.inf
        for r in range(REPEATS):
            prefix = [rng.randrange(vocab) for _ in range(cached)]
            if cached:
                await _run(engine, f"profile-prefix-{i}-{r}", prefix, one)
            start = time.perf_counter()
            await _run(engine, f"profile-prefill-{i}-{r}", prefix + [rng.randrange(vocab) for _ in range(new)], one)
            fastest = min(fastest, time.perf_counter() - start)
        reused = cached // engine.layout.block_size * engine.layout.block_size if engine.role != "decode" else 0
        samples.append((new + cached - reused, attention_work(new + cached - reused, reused), fastest))
    return samples


async def _decode_samples(engine: VllmEngine, rng: random.Random) -> list[tuple[int, int, float]]:
    vocab = engine.layout.vocab_size
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    samples = []
    for i, (batch, context) in enumerate(DECODE_SHAPES):
        runs = [
            _run(engine, f"profile-decode-{i}-{j}", [rng.randrange(vocab) for _ in range(context)], params)
            for j in range(batch)
        ]
        arrivals = await asyncio.gather(*runs)
        all_started = max(times[0] for times in arrivals)
        gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if a >= all_started]
        samples.append((batch, batch * (context + 1), min(gaps) if gaps else math.inf))
    return [s for s in samples if math.isfinite(s[2])]


async def profile_vllm(engine: VllmEngine, seed: int = 0) -> CostRefiner:
    """Profile vLLM alone on the host, then empty its prefix cache (the profile's blocks are not worth announcing)."""
    rng = random.Random(seed)
    with LOCK_PATH.open("a") as lock:
        log.info("profiling vLLM: waiting for the other workers on this host to finish theirs")
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
        try:
            start = time.monotonic()
            await _run(engine, "profile-warmup", [rng.randrange(engine.layout.vocab_size) for _ in range(64)],
                       SamplingParams(max_tokens=2, temperature=0))  # fmt: skip
            refiner = CostRefiner(await _prefill_samples(engine, rng), await _decode_samples(engine, rng))
            log.info("profiled vLLM in %.1f s", time.monotonic() - start)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    await engine.llm.reset_prefix_cache()
    await asyncio.sleep(0.5)  # let the AllBlocksCleared event arrive before the first real request
    engine.events.pop()
    engine.events.pop_store_puts()  # its random prompts put into the Store ([store] enabled): no one's prefix
    engine.stats.prefix_queries = engine.stats.prefix_hits = 0
    return refiner
