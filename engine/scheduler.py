"""Continuous-batching scheduler: admission, chunked prefill, decode, and finishing.

As in vLLM v1 there is no prefill or decode phase, only computed vs. total tokens:
each step packs, within ``max_num_batched_tokens``, first one token for every
decoding request (so a stream of arrivals never stalls running decodes), then the
next prompt chunk of every request still prefilling, then the first chunks of
newly admitted requests. A request is admitted only when the blocks for the whole
request can be allocated, so decode never runs out of blocks and nothing is ever
preempted. Admission is FIFO: the head of the queue is never skipped.
"""

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.outputs import StepOutput
from engine.request import Request, RequestStatus
from engine.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step and how many new tokens each computes."""

    requests: list[Request]
    num_new_tokens: list[int]

    def sample_rows(self) -> list[int]:
        """Rows whose chunk reaches the end of their known tokens: they sample a token this step."""
        pairs = zip(self.requests, self.num_new_tokens, strict=True)
        return [i for i, (r, n) in enumerate(pairs) if r.num_computed_tokens + n == r.num_tokens]


class Scheduler:
    """Owns the waiting/running queues and every block a request holds."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        eos_token_ids: Sequence[int],
        max_num_prefills: int | None = None,
    ) -> None:
        """Create empty queues; limits must be positive.

        ``max_num_prefills`` caps the requests whose prompt chunks share one step (None: as many as the
        token budget holds). 1 runs prompts first come, first served, one at a time: a prompt's TTFT is
        then its queue plus its own compute, not stretched by later prompts packed into its last step.
        """
        if min(max_model_len, max_num_batched_tokens, max_num_seqs, max_num_prefills or 1) <= 0:
            raise ValueError("max_model_len, max_num_batched_tokens, max_num_seqs, max_num_prefills must be positive")
        self.max_num_prefills = max_num_prefills
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished prefill-only requests keeping their blocks

    def num_blocks_for(self, num_prompt_tokens: int, params: SamplingParams, prefill_only: bool) -> int:
        """Blocks a request reserves: prompt plus ``max_tokens`` (capped at max_model_len), or prompt only."""
        if num_prompt_tokens <= 0:
            raise ValueError("prompt must not be empty")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens leaves no room in max_model_len {self.max_model_len}"
            )
        total = num_prompt_tokens if prefill_only else min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        needed = -(-total // self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request needs {needed} KV blocks but the pool has {self.block_manager.num_blocks}")
        return needed

    def add(self, request: Request) -> None:
        """Queue a request; raises ValueError if it could never fit."""
        self.num_blocks_for(request.num_prompt_tokens, request.params, request.prefill_only)
        self.waiting.append(request)

    def add_running(self, request: Request, first_token_id: int) -> StepOutput | None:
        """Start decoding a request whose prompt KV is in its blocks; returns the output if it finishes."""
        request.status = RequestStatus.RUNNING
        self._commit_blocks(request)
        output = self._append_token(request, first_token_id)
        if not output.finished:
            self.running.append(request)
            return None
        return output

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch (decodes, then prefill chunks, then admissions), or None if idle."""
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if not r.is_prefilling]
        prefilling = [r for r in self.running if r.is_prefilling][: self.max_num_prefills]
        for request in [*decoding, *prefilling]:
            if budget > 0:
                budget -= self._add_chunk(batch, request, budget)
        num_prefills, limit = len(prefilling), self.max_num_prefills or math.inf
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and num_prefills < limit:
            if not self._admit(self.waiting[0]) and not (self._drop_pins() and self._admit(self.waiting[0])):
                break
            request = self.waiting.popleft()
            self.running.append(request)
            budget -= self._add_chunk(batch, request, budget)
            num_prefills += 1
        return batch if batch.requests else None

    def update(self, batch: ScheduledBatch, sampled: dict[int, tuple[int, float | None]]) -> list[StepOutput]:
        """Advance the batch's requests after the forward.

        ``sampled`` maps batch rows to (new token, its logprob or None). Prefill-only
        requests in the middle of their prompt report progress (see ``StepOutput``).
        """
        outputs = []
        for row, (request, num_new) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True)):
            request.num_computed_tokens += num_new
            self._commit_blocks(request)
            if row in sampled:
                outputs.append(self._append_token(request, *sampled[row]))
            elif request.prefill_only:
                outputs.append(self._progress(request))
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks; unknown ids are ignored."""
        for request in [r for r in self.waiting if r.request_id == request_id]:
            self.block_manager.free(request.pinned)
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        for request in [r for r in self.running if r.request_id == request_id]:
            self.running.remove(request)
            self.block_manager.free(request.block_table)
        self.release(request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request held; unknown ids are ignored."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request.block_table)

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, request: Request, budget: int) -> int:
        """Add the next tokens of ``request`` without KV (at most ``budget``); return how many."""
        size = min(request.num_tokens - request.num_computed_tokens, budget)
        batch.requests.append(request)
        batch.num_new_tokens.append(size)
        return size

    def _admit(self, request: Request) -> bool:
        """Give ``request`` its cached prefix blocks plus new ones for the rest, or leave it unchanged."""
        manager = self.block_manager
        needed = self.num_blocks_for(request.num_prompt_tokens, request.params, request.prefill_only)
        # Cap the match so the last prompt token is always recomputed (its logits give the first token).
        hashes = request.full_block_hashes(manager.block_size, request.num_prompt_tokens - 1)
        hits = manager.match_prefix(hashes, request.prompt_token_ids)
        new_blocks = manager.allocate(needed - len(hits))
        if new_blocks is None:
            manager.free(hits)
            return False
        request.block_table = hits + new_blocks
        request.num_computed_tokens = request.num_cached_tokens = len(hits) * manager.block_size
        request.num_committed_blocks = len(hits)
        manager.free(request.pinned)  # its prefix is in its block table now, with references of its own
        request.pinned = []
        manager.record_prefix_lookup(request.num_prompt_tokens, request.num_cached_tokens)
        request.status = RequestStatus.RUNNING
        return True

    def _drop_pins(self) -> bool:
        """Free the blocks the queue's later requests pin (they may be evicted now); whether there were any.

        Pins keep a waiting request's copied prefix from eviction by the requests admitted before it, but
        never hold up the queue: the head of the queue that does not fit otherwise gets their blocks.
        """
        pinned = [r for r in list(self.waiting)[1:] if r.pinned]
        for request in pinned:
            self.block_manager.free(request.pinned)
            request.pinned = []
        return bool(pinned)

    def _commit_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        manager = self.block_manager
        hashes = request.full_block_hashes(manager.block_size, request.num_computed_tokens)
        if len(hashes) == request.num_committed_blocks:  # no block completed since (most decode steps)
            return
        manager.commit_full_blocks(request.block_table, hashes, request.token_ids, request.num_committed_blocks)
        request.num_committed_blocks = len(hashes)

    def _progress(self, request: Request) -> StepOutput:
        """A prefill-only request's chunk progress: the blocks holding its computed KV so far."""
        num_blocks = -(-request.num_computed_tokens // self.block_manager.block_size)
        return StepOutput(
            request.request_id,
            [],
            False,
            None,
            request.num_cached_tokens,
            request.block_table[:num_blocks],
            num_computed_tokens=request.num_computed_tokens,
        )

    def _append_token(self, request: Request, token_id: int, logprob: float | None = None) -> StepOutput:
        """Record a sampled token, finish the request if a stop condition holds, and report it."""
        request.output_token_ids.append(token_id)
        reason = self._finish_reason(request)
        finished = reason is not None or request.prefill_only
        block_ids: list[int] = []
        if finished:
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
            if request.prefill_only:
                self.held[request.request_id] = request
                block_ids = list(request.block_table)
            else:
                self.block_manager.free(request.block_table)
        return StepOutput(
            request.request_id,
            [token_id],
            finished,
            reason,
            request.num_cached_tokens,
            block_ids,
            num_computed_tokens=request.num_computed_tokens,
            logprobs=[] if logprob is None else [logprob],
        )

    def _finish_reason(self, request: Request) -> str | None:
        """Return "stop", "length" or None for a request whose last output token was just added."""
        params, token_id = request.params, request.output_token_ids[-1]
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None
