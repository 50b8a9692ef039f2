"""Request: the state of one sequence in the engine.

Token segments of a request (``num_computed_tokens`` counts tokens whose KV is in
the pool; the last sampled token never has KV yet)::

    |<------------- prompt_token_ids ------------->|<---- output_token_ids ---->|
    |<- num_cached_tokens ->|                      |                            |
    |<------------------ num_computed_tokens -------------------->|  to compute |

``block_table`` is reserved for the whole request at admission (prompt plus
``max_tokens``, capped at ``max_model_len``), so decoding never runs out of blocks.
"""

from dataclasses import dataclass, field
from enum import Enum

from engine.block_hash import hash_block
from engine.sampling import SamplingParams


class RequestStatus(Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED (prefill-only requests may hold blocks when FINISHED)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence: its tokens, its KV blocks and how far its KV has been computed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, extended on demand
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    pinned: list[int] = field(default_factory=list)  # cached blocks held for it until admitted (a KV copy's)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Length of prompt plus output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while part of the prompt still has no KV."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def next_token_ids(self, num_tokens: int) -> list[int]:
        """The ``num_tokens`` tokens after the computed ones (the next chunk to run)."""
        start, num_prompt = self.num_computed_tokens, self.num_prompt_tokens
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : start - num_prompt + num_tokens]
        return self.token_ids[start : start + num_tokens]

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Extend ``block_hashes`` to every full block of the first ``num_tokens`` tokens and return them."""
        tokens = self.token_ids
        while (len(self.block_hashes) + 1) * block_size <= num_tokens:
            start = len(self.block_hashes) * block_size
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, tokens[start : start + block_size]))
        return self.block_hashes
