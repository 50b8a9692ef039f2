"""Benchmark workloads: lists of ``BenchRequest`` (prompt token ids, output length, optional arrival time).

Prompts are token ids drawn from the lowercase letters ``a``..``z`` (ids 97..122), so the same prompt
can be sent as a token-id list (``/v1/completions``) or as text (``/v1/chat/completions``). With
kvconductor's byte-level tokenizer (token id = byte value) the text is exactly as many tokens as ids;
other tokenizers merge letters, so lengths are then approximate, but equal prefixes stay equal.

Trace replay (Mooncake FAST'25 format, 512-token blocks named by ``hash_ids``)::

    trace block (512 tokens, id h)  --length_scale 1/32-->  16 real tokens = tokens_of_block(h)
    prompt  = tokens_of_block(h0) + tokens_of_block(h1) + ...   cut to ceil(input_length * length_scale)
    output  = min(max_output_tokens, max(1, ceil(output_length * output_scale)))
    arrival = timestamp_ms / 1000 * time_scale   (seconds after the start)

``tokens_of_block`` depends only on (seed, hash id), so requests with equal leading ``hash_ids`` get
equal leading token blocks: exactly the prefix sharing of the trace, shrunk by ``length_scale``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash-block size
ALPHABET = tuple(range(ord("a"), ord("z") + 1))  # token ids = printable bytes under a byte-level tokenizer
DEFAULT_TRACE = "/work/shared/traces/mooncake/conversation_trace.jsonl"


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: what to send and, for open-loop trace replay, when."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float | None = None  # offset from the start of the run (trace timestamps only)

    @property
    def text(self) -> str:
        """The prompt as text (one character per token id)."""
        return bytes(self.prompt_ids).decode("ascii")


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """``n`` random token ids from the alphabet."""
    return tuple(rng.choice(ALPHABET) for _ in range(n))


def shared_prefix(
    num_prefixes: int, suffixes_per_prefix: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """N prefixes x M distinct suffixes, ordered round-robin over the prefixes (p0s0, p1s0, ..., p0s1, ...)."""
    if min(num_prefixes, suffixes_per_prefix, output_len) < 1 or min(prefix_len, suffix_len) < 0:
        raise ValueError("shared-prefix needs >= 1 prefix, suffix and output token, and non-negative lengths")
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    return [
        BenchRequest(prefix + random_tokens(rng, suffix_len), output_len)
        for _ in range(suffixes_per_prefix)
        for prefix in prefixes
    ]


def random_lengths(
    num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0
) -> list[BenchRequest]:
    """Independent random prompts; lengths uniform in the inclusive ranges."""
    (in_lo, in_hi), (out_lo, out_hi) = input_range, output_range
    if not (1 <= in_lo <= in_hi and 1 <= out_lo <= out_hi):
        raise ValueError(f"bad length ranges: input {input_range}, output {output_range} (need 1 <= lo <= hi)")
    rng = random.Random(seed)
    return [
        BenchRequest(random_tokens(rng, rng.randint(in_lo, in_hi)), rng.randint(out_lo, out_hi))
        for _ in range(num_requests)
    ]


@dataclass(frozen=True)
class TraceScale:
    """How a trace shrinks to fit this machine (see the module docstring)."""

    length_scale: float = 1 / 32  # real tokens per trace token (prompt)
    output_scale: float | None = None  # real tokens per trace output token; None = length_scale
    max_output_tokens: int = 64  # cap after scaling
    max_input_tokens: int = 2048  # prompts are cut to this (keeps the shared prefix)
    time_scale: float = 1.0  # seconds of replay per trace second
    seed: int = 0  # seeds the block contents

    @property
    def block_tokens(self) -> int:
        """Real tokens per 512-token trace block."""
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


def block_tokens(hash_id: int, n: int, seed: int = 0) -> tuple[int, ...]:
    """The token block of one trace hash id: a pure function of (seed, hash id)."""
    return random_tokens(random.Random(seed * 1_000_003 + hash_id), n)


def trace_request(record: dict[str, object], scale: TraceScale) -> BenchRequest:
    """One trace line as a request (fields: timestamp, input_length, output_length, hash_ids)."""
    hash_ids = [int(h) for h in record["hash_ids"]]  # type: ignore[attr-defined]
    input_len = math.ceil(int(record["input_length"]) * scale.length_scale)  # type: ignore[call-overload]
    input_len = max(1, min(input_len, len(hash_ids) * scale.block_tokens, scale.max_input_tokens))
    prompt: list[int] = []
    for h in hash_ids:
        if len(prompt) >= input_len:
            break
        prompt += block_tokens(h, scale.block_tokens, scale.seed)
    out_scale = scale.length_scale if scale.output_scale is None else scale.output_scale
    output = math.ceil(int(record["output_length"]) * out_scale)  # type: ignore[call-overload]
    arrival = int(record["timestamp"]) / 1000 * scale.time_scale  # type: ignore[call-overload]
    return BenchRequest(tuple(prompt[:input_len]), min(scale.max_output_tokens, max(1, output)), arrival)


def load_trace(path: str | Path, limit: int | None, scale: TraceScale) -> list[BenchRequest]:
    """The first ``limit`` requests of a Mooncake JSONL trace, arrivals shifted to start at 0."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    requests: list[BenchRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                requests.append(trace_request(json.loads(line), scale))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from e
    start = (requests[0].arrival_s or 0.0) if requests else 0.0
    return [BenchRequest(r.prompt_ids, r.max_tokens, (r.arrival_s or 0.0) - start) for r in requests]
