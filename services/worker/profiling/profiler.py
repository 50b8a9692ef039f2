"""The start-up profile: time real prefills and decode steps on this worker, fit the cost models.

An emulated engine's profile is not timed: it is what its latency profile says the emulated hardware
would measure (``emulated_profile``), over shapes up to long contexts; its timed steps refine it online.

Runs before the worker registers, so the Conductor never schedules on an instance without a fitted
model. Prompts are random token ids from a fixed seed. Each shape is timed ``REPEATS`` times and the
fastest run kept, and workers on one host take turns (an exclusive lock file): profiles run at the same
time on shared cores would measure each other, and the Conductor would then see differences between
identical instances that are only noise. The profile takes a few seconds on the default model.
"""

from __future__ import annotations

import fcntl
import logging
import math
import random
import tempfile
import time
from pathlib import Path

from engine.emulated_runner import Emulation
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from scheduler.cost_model import attention_work
from services.worker.profiling.refiner import CostRefiner

PREFILL_SHAPES = ((16, 0), (64, 0), (256, 0), (512, 0), (128, 256), (256, 512))  # (new, cached) tokens
DECODE_SHAPES = ((1, 64), (1, 512), (4, 128), (8, 64), (8, 256))  # (batch, context per sequence)
DECODE_STEPS = 4
REPEATS = 3
SHAPES = (PREFILL_SHAPES, DECODE_SHAPES, DECODE_STEPS, REPEATS)  # what a kept profile was measured at
EMULATED_PREFILL_SHAPES = tuple((new, cached) for new in (16, 256, 2048, 8192, 32768) for cached in (0, new))
EMULATED_DECODE_SHAPES = tuple((batch, context) for batch in (1, 8, 32, 128) for context in (256, 4096, 32768))
LOCK_PATH = Path(tempfile.gettempdir()) / "kvconductor-profile.lock"
log = logging.getLogger(__name__)


def _tokens(rng: random.Random, engine: LLMEngine, n: int) -> list[int]:
    return [rng.randrange(engine.config.vocab_size) for _ in range(n)]


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile_prefill(engine: LLMEngine, rng: random.Random) -> list[tuple[int, float, float]]:
    """Time prefills of several (new, cached) shapes; cached prefixes come from the prefix cache."""
    samples: list[tuple[int, float, float]] = []
    greedy_one = SamplingParams(max_tokens=1)
    for i, (new, cached) in enumerate(PREFILL_SHAPES):
        fastest = math.inf
        for r in range(REPEATS):
            prefix = _tokens(rng, engine, cached)
            if cached:
                engine.add_request(f"profile-prefix-{i}-{r}", prefix, greedy_one)
                _run_to_completion(engine)
            engine.add_request(f"profile-prefill-{i}-{r}", prefix + _tokens(rng, engine, new), greedy_one)
            start = time.perf_counter()
            _run_to_completion(engine)
            fastest = min(fastest, time.perf_counter() - start)
        reused = cached if engine.block_manager.enable_prefix_caching else 0
        samples.append((new + cached - reused, attention_work(new + cached - reused, reused), fastest))
    return samples


def profile_decode(engine: LLMEngine, rng: random.Random) -> list[tuple[int, int, float]]:
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
        steps = []
        for _ in range(DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        samples.append((batch, batch * (context + 1), min(steps)))
        _run_to_completion(engine)
    return samples


def profile_engine(engine: LLMEngine, seed: int = 0) -> CostRefiner:
    """Profile this engine, alone on the host; the refiner holds the samples and fits the models."""
    rng = random.Random(seed)
    with LOCK_PATH.open("a") as lock:
        log.info("profiling the engine: waiting for the other workers on this host to finish theirs")
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            start = time.monotonic()
            log.info("profiling the engine: %d prefill and %d decode shapes, %d runs each",
                     len(PREFILL_SHAPES), len(DECODE_SHAPES), REPEATS)  # fmt: skip
            engine.add_request("profile-warmup", _tokens(rng, engine, 64), SamplingParams(max_tokens=2))
            _run_to_completion(engine)
            refiner = CostRefiner(profile_prefill(engine, rng), profile_decode(engine, rng))
            log.info("profiled in %.1f s", time.monotonic() - start)
            return refiner
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def emulated_profile(emulation: Emulation, error: float = 0.0, seed: str = "") -> CostRefiner:
    """An emulated engine's start-up profile: its step times at the emulated shapes, scaled as it waits them.

    With ``error`` (a log-normal sigma) every time is off by exp(bias + noise): the bias drawn once from
    N(0, error), the noise per shape, both from ``seed`` (``[emulation] profile_error``: model error).
    """
    rng = random.Random(seed)
    bias = rng.gauss(0.0, error) if error else 0.0

    def off() -> float:
        return math.exp(bias + rng.gauss(0.0, error)) if error else 1.0

    scale, prefill, decode = emulation.time_scale, emulation.prefill, emulation.decode
    return CostRefiner(
        [(n, attention_work(n, c), prefill.predict(n, c) * scale * off()) for n, c in EMULATED_PREFILL_SHAPES],
        [(b, b * c, decode.predict(b, b * c) * scale * off()) for b, c in EMULATED_DECODE_SHAPES],
    )
