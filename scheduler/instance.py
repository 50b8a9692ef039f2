"""An instance as the Conductor core sees it: its cost models, its limits and the work booked on it.

The live Conductor keeps one per registered worker (refreshed from its etcd record, bookings kept) and
the simulator one per simulated instance; both turn them into the policy's candidates here, so the two
cannot disagree about what an instance looks like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.booking import Bookings
from scheduler.cost_model import DecodeModel, PrefillModel
from scheduler.policy import DecodeCandidate, PrefillCandidate


@dataclass
class InstanceState:
    """One prefill, decode or colocated instance."""

    instance_id: str
    role: str  # "prefill", "decode" or "colocated"
    prefill_model: PrefillModel
    decode_model: DecodeModel
    num_blocks: int  # KV capacity, blocks
    max_running: int  # max_concurrent_requests
    chunk_tokens: int  # max_num_batched_tokens: the prefill chunk (and a colocated step's token budget)
    profile: tuple[PrefillModel, DecodeModel] | None = None  # the start-up profile's models
    exports_kv: bool = True  # its cached blocks can be copied to a peer
    prefilling: Bookings = field(default_factory=Bookings)  # requests whose prefill runs here
    decoding: Bookings = field(default_factory=Bookings)  # requests decoding (or about to) here

    def prefill_candidate(self, prefix_len: int, now: float) -> PrefillCandidate:
        """The instance as a prefill candidate for a request of which it holds ``prefix_len`` tokens."""
        t_queue = self.prefilling.t_queue(now)
        profile = self.profile[0] if self.profile else None
        in_flight, queued = self.prefilling.in_prefill()
        if self.role != "colocated":
            return PrefillCandidate(
                self.instance_id, prefix_len, t_queue, self.prefill_model, chunk_tokens=self.chunk_tokens,
                idle=not self.prefilling, profile=profile, in_flight=in_flight, queued_new_tokens=queued,
                exports_kv=self.exports_kv,
            )  # fmt: skip
        decoding = [r for r in self.decoding.residents(now) if r.t_join <= 0]
        step = self.decode_model.predict(len(decoding), sum(r.context for r in decoding))
        return PrefillCandidate(
            self.instance_id, prefix_len, t_queue, self.prefill_model, decode_step_s=step,
            step_tokens=self.chunk_tokens, idle=not self.prefilling and not self.decoding, profile=profile,
            in_flight=in_flight, queued_new_tokens=queued, exports_kv=self.exports_kv,
        )  # fmt: skip

    def decode_candidate(self, now: float) -> DecodeCandidate:
        """The instance as a decode candidate."""
        return DecodeCandidate(
            self.instance_id,
            residents=self.decoding.residents(now),
            num_free_blocks=self.num_blocks - self.decoding.num_blocks,
            max_running=self.max_running,
            model=self.decode_model,
            profile=self.profile[1] if self.profile else None,
        )
