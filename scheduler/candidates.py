"""What one scheduling decision sees and estimates: the request, each candidate instance, its estimate.

Snapshots, taken by the live Conductor from its cluster view and by the simulator from its instances, so that
``scheduler.policy`` (Algorithm 1, admission) and ``scheduler.rules`` (the baselines and peers' rules) decide
over the same values.

A decision builds a candidate and an estimate per instance: those classes are plain slotted dataclasses, never
changed once built. Frozen ones cost four times as much to build (1.8 against 0.5 us for 14 fields, here),
which at 256 instances was a millisecond of every decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.cost_model import DecodeModel, PrefillModel


def exposed_tokens(num_prompt_tokens: int, reused: int, chunk_tokens: int) -> int:
    """Prompt tokens whose KV is still to send to decode after token 0.

    A prefill in one chunk sends the whole prompt's KV after it; in several chunks the KV of the reused
    prefix and of every chunk but the last streams out while later chunks compute, so only the last
    chunk's is exposed. ``chunk_tokens`` 0: no streaming.
    """
    new = num_prompt_tokens - reused
    if chunk_tokens <= 0 or new <= chunk_tokens:
        return num_prompt_tokens
    return new - (new - 1) // chunk_tokens * chunk_tokens


@dataclass(slots=True)
class PrefillCandidate:
    """A prefill (or colocated) instance as the Conductor sees it for one request."""

    instance_id: str
    prefix_len: int  # prompt tokens whose KV this instance holds (whole blocks) when the request runs there
    t_queue: float  # seconds of prefill work queued ahead of the request
    model: PrefillModel
    chunk_tokens: int = 0  # prefill chunk; KV of earlier chunks streams out during later ones (0 = no streaming)
    # On a colocated instance every engine step carries the running batch's decode tokens too, so a prompt's
    # prefill takes ceil(new / step_tokens) steps each longer by decode_step_s (0 on a prefill instance).
    decode_step_s: float = 0.0
    step_tokens: int = 0
    idle: bool = False  # nothing queued or running here (the admission probe's condition)
    profile: PrefillModel | None = None  # the instance's start-up profile (admission's reference when idle)
    in_flight: int = 0  # requests whose prefill is queued or running here (the peers' rules count them)
    queued_new_tokens: int = 0  # tokens still to compute for them
    exports_kv: bool = True  # peers can copy its cached blocks (False for a vLLM instance without a KV connector)
    # Of prefix_len, the tokens cached now (a peer can copy them); the rest is computed by prefills queued
    # here (``Bookings.queued_prefix``). None: all of prefix_len is cached.
    cached_len: int | None = None
    # Its engine copies KV by running a request on each side (vLLM's KV connector): the exporter's waits for
    # the prefill running there (``t_export`` seconds) and computes the prefix's last block again, the
    # importer's takes a step of its own. False: peers read and write the pool without waiting for a step.
    copies_by_request: bool = False
    t_export: float = 0.0

    @property
    def cached(self) -> int:
        """Prompt tokens cached here now: what a copy from this instance can take."""
        return self.prefix_len if self.cached_len is None else self.cached_len

    def t_prefill(self, new_tokens: int, cached_tokens: int) -> float:
        """Predicted prefill time here, including the decode steps it shares on a colocated instance."""
        t = self.model.predict(new_tokens, cached_tokens)
        if self.decode_step_s > 0 and self.step_tokens > 0 and new_tokens > 0:
            t += math.ceil(new_tokens / self.step_tokens) * self.decode_step_s
        return t

    def t_export_of(self, cached_tokens: int, block_size: int) -> float:
        """Seconds before a copy of ``cached_tokens`` from here can start (``copies_by_request``)."""
        if not self.copies_by_request or cached_tokens < block_size:
            return 0.0
        return self.t_export + self.model.predict(block_size, cached_tokens - block_size)

    def t_import(self, copied_prefix: int) -> float:
        """Seconds a copy costs here beyond moving its bytes: the import's own step (``copies_by_request``)."""
        return self.model.predict(1, copied_prefix - 1) if self.copies_by_request and copied_prefix > 0 else 0.0

    def exposed_tokens(self, num_prompt_tokens: int, reused: int) -> int:
        """Prompt tokens whose KV is still to send after token 0 here (see ``exposed_tokens``)."""
        return exposed_tokens(num_prompt_tokens, reused, self.chunk_tokens)


@dataclass(slots=True)
class Resident:
    """A request on a decode instance; times in seconds relative to now."""

    t_join: float  # when it starts decoding (<= 0: decoding already)
    t_leave: float  # when it is expected to finish
    context: int  # tokens it attends to
    stalls: tuple[tuple[int, float], ...] = ()  # its steps stalled by prompts prefilled there (Booking.stalls)


@dataclass(slots=True)
class DecodeCandidate:
    """A decode (or colocated) instance's load."""

    instance_id: str
    residents: tuple[Resident, ...]
    num_free_blocks: int
    max_running: int  # max_concurrent_requests
    model: DecodeModel
    profile: DecodeModel | None = None  # the instance's start-up profile (admission's reference when idle)

    def has_room(self, request: RequestShape) -> bool:
        """Free KV blocks for the whole request and a free slot."""
        return self.num_free_blocks >= request.num_blocks and len(self.residents) < self.max_running

    def predicted_tbt(self, at: float, context: int) -> float:
        """Step time at time ``at`` with one more request of ``context`` tokens in the batch."""
        batch = [r for r in self.residents if r.t_join <= at < r.t_leave]
        return self.model.predict(len(batch) + 1, sum(r.context for r in batch) + context)


@dataclass(frozen=True)
class RequestShape:
    """What the policy needs to know about a request."""

    num_prompt_tokens: int
    num_blocks: int  # KV blocks the decode instance must reserve (prompt + max_tokens)
    block_size: int
    bytes_per_block: int
    output_tokens: int = 0  # completion tokens expected (0: unknown; the colocated cost then counts prefill only)

    def usable_prefix(self, prefix_len: int) -> int:
        """Reusable cached tokens: whole blocks, leaving the last prompt token to compute."""
        return min(prefix_len, (self.num_prompt_tokens - 1) // self.block_size * self.block_size)

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of the KV blocks holding ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size) * self.bytes_per_block


@dataclass(frozen=True)
class Slo:
    """Service-level objectives, seconds."""

    max_ttft: float
    max_tbt: float
    reject: bool = True
    # Time every request spends outside the instances (client hops, scheduling, relaying), learned by the
    # Conductor from measured TTFTs; the same for every candidate, so it counts for admission only.
    ttft_overhead: float = 0.0


@dataclass(slots=True)
class PrefillEstimate:
    """Algorithm 1's estimates for one prefill candidate."""

    instance_id: str
    prefix_len: int  # reused tokens: its own, or best_len when the plan copies
    t_queue: float
    t_transfer: float  # KV copy from the best holder (0 without a copy)
    t_prefill: float
    t_send: float  # prompt KV to the decode instance
    copy_from: str = ""  # best holder to copy from; empty = no copy
    copy_tokens: int = 0  # tokens of KV copied (best_len - own prefix)
    # Colocated only: the request's decode time there plus the delay it imposes on the requests decoding
    # there (its prompt's chunks stall their steps; its place in the batch lengthens every later step).
    t_shared: float = 0.0
    queued_tokens: int = 0  # of prefix_len, tokens that prompts queued ahead of it leave there (not cached yet)

    @property
    def ttft(self) -> float:
        """Predicted time to first token."""
        return self.t_queue + self.t_transfer + self.t_prefill + self.t_send

    @property
    def cost(self) -> float:
        """What Algorithm 1 minimises: the TTFT, plus on a colocated instance ``t_shared``."""
        return self.ttft + self.t_shared

    def with_shared(self, t_shared: float) -> PrefillEstimate:
        """The estimate with ``t_shared`` (``dataclasses.replace`` costs 5x more, once per candidate per request)."""
        return PrefillEstimate(self.instance_id, self.prefix_len, self.t_queue, self.t_transfer, self.t_prefill,
                               self.t_send, self.copy_from, self.copy_tokens, t_shared, self.queued_tokens)  # fmt: skip
