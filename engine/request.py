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

from engine.block_hash import prefix_block_hashes
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

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end`` of the prompt followed by the output, without copying the rest of either."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return output[start - n : end - n]
        return prompt[start:] + output[: end - n]

    def next_token_ids(self, num_tokens: int) -> list[int]:
        """The ``num_tokens`` tokens after the computed ones (the next chunk to run)."""
        return self.tokens(self.num_computed_tokens, self.num_computed_tokens + num_tokens)

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Extend ``block_hashes`` to every full block of the first ``num_tokens`` tokens and return them.

        Called for every request at every step: it hashes only the blocks completed since (in C, all at once).
        """
        done, full = len(self.block_hashes), num_tokens // block_size
        if full > done:
            parent = self.block_hashes[-1] if done else None
            tokens = self.tokens(done * block_size, full * block_size)
            self.block_hashes.extend(prefix_block_hashes(tokens, block_size, parent))
        return self.block_hashes
