"""The Mooncake (FAST'25) trace format: one JSON request per line.

Each line has ``timestamp`` (ms since the start), ``input_length``, ``output_length`` and ``hash_ids``:
block i's id stands for the prompt up to the end of 512-token block i, so equal leading ids are an
equal reusable prefix. The simulator uses the ids as chained block hashes (8 little-endian bytes, the
type the KV index stores); the last block may be partial (``tail``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

TRACE_BLOCK_SIZE = 512
DEFAULT_TRACE = Path("/work/shared/traces/mooncake/conversation_trace.jsonl")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, times in seconds."""

    request_id: int
    arrival: float
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[bytes, ...]  # one per prompt block, the last one possibly partial

    @property
    def full_blocks(self) -> tuple[bytes, ...]:
        """Hashes of the prompt's full blocks: what a cache stores after the prefill."""
        return self.block_hashes[: self.num_prompt_tokens // TRACE_BLOCK_SIZE]

    @property
    def tail(self) -> tuple[bytes, int] | None:
        """The block the prompt ends inside and its tokens of it (None: the prompt ends on a block boundary)."""
        k = self.num_prompt_tokens % TRACE_BLOCK_SIZE
        return (self.block_hashes[-1], k) if k else None


def block_hash(hash_id: int) -> bytes:
    """A trace hash id as the bytes the KV index keys on."""
    return hash_id.to_bytes(8, "little", signed=False)


def parse_line(request_id: int, line: str, speed: float = 1.0) -> TraceRequest:
    """One trace line; ``speed`` > 1 compresses time (2.0 = twice as fast)."""
    row = json.loads(line)
    n = int(row["input_length"])
    hashes = tuple(block_hash(int(h)) for h in row["hash_ids"])
    if len(hashes) != -(-n // TRACE_BLOCK_SIZE):
        raise ValueError(f"line {request_id + 1}: {len(hashes)} hash_ids for {n} tokens of {TRACE_BLOCK_SIZE}")
    return TraceRequest(request_id, row["timestamp"] / 1e3 / speed, n, max(1, int(row["output_length"])), hashes)


def load_trace(
    path: Path | str = DEFAULT_TRACE, speed: float = 1.0, limit: int | None = None, max_output_tokens: int | None = None
) -> list[TraceRequest]:
    """Requests of a trace file in arrival order, the first ``limit`` of them when given, outputs capped."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    requests: list[TraceRequest] = []
    with Path(path).open() as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                r = parse_line(len(requests), line, speed)
                if max_output_tokens is not None and r.num_output_tokens > max_output_tokens:
                    r = replace(r, num_output_tokens=max_output_tokens)
                requests.append(r)
    return sorted(requests, key=lambda r: (r.arrival, r.request_id))
