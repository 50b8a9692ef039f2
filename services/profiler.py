"""The start-up profile: time real prefills and decode steps on this worker, fit the cost models.

Runs before the worker registers, so the Conductor never schedules on an instance without a fitted
model. Prompts are random token ids from a fixed seed; the profile takes about a second on the
default model with one thread.
"""

from __future__ import annotations

import random
import time

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from scheduler.cost_model import DecodeModel, PrefillModel

PREFILL_SHAPES = ((16, 0), (64, 0), (256, 0), (512, 0), (128, 256), (256, 512))  # (new, cached) tokens
DECODE_SHAPES = ((1, 64), (1, 512), (4, 128), (8, 64), (8, 256))  # (batch, context per sequence)
DECODE_STEPS = 4


def _tokens(rng: random.Random, engine: LLMEngine, n: int) -> list[int]:
    return [rng.randrange(engine.config.vocab_size) for _ in range(n)]


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile_prefill(engine: LLMEngine, rng: random.Random) -> PrefillModel:
    """Time prefills of several (new, cached) shapes; cached prefixes come from the prefix cache."""
    samples: list[tuple[int, int, float]] = []
    greedy_one = SamplingParams(max_tokens=1)
    for i, (new, cached) in enumerate(PREFILL_SHAPES):
        prefix = _tokens(rng, engine, cached)
        if cached:
            engine.add_request(f"profile-prefix-{i}", prefix, greedy_one)
            _run_to_completion(engine)
        rid = f"profile-prefill-{i}"
        engine.add_request(rid, prefix + _tokens(rng, engine, new), greedy_one)
        start = time.perf_counter()
        _run_to_completion(engine)
        reused = cached if engine.block_manager.enable_prefix_caching else 0
        samples.append((new + cached - reused, reused, time.perf_counter() - start))
    return PrefillModel.fit(samples)


def profile_decode(engine: LLMEngine, rng: random.Random) -> DecodeModel:
    """Time decode steps at several batch sizes and contexts."""
    samples: list[tuple[int, int, float]] = []
    for i, (batch, context) in enumerate(DECODE_SHAPES):
        params = SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True)
        ids = {f"profile-decode-{i}-{j}" for j in range(batch)}
        for rid in ids:
            engine.add_request(rid, _tokens(rng, engine, context), params)
        started: set[str] = set()
        while started != ids:  # prefill steps until every sequence has its first token
            started.update(out.request_id for out in engine.step())
        for step in range(DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            samples.append((batch, batch * (context + step + 1), time.perf_counter() - start))
        _run_to_completion(engine)
    return DecodeModel.fit(samples)


def profile_engine(engine: LLMEngine, seed: int = 0) -> tuple[PrefillModel, DecodeModel]:
    """Fit both cost models on this engine."""
    rng = random.Random(seed)
    return profile_prefill(engine, rng), profile_decode(engine, rng)
