"""An instance as the Conductor core sees it: its cost models, its limits and the work booked on it.

The live Conductor keeps one per registered worker (refreshed from its etcd record, bookings kept) and
the simulator one per simulated instance; both turn them into the policy's candidates here, so the two
cannot disagree about what an instance looks like.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from scheduler.booking import Bookings
from scheduler.candidates import DecodeCandidate, PrefillCandidate, Resident
from scheduler.cost_model import DecodeModel, PrefillModel


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
    # Its engine's own KV connector moves its KV (vLLM's): the prompt's KV goes to decode after the prefill (not
    # while later chunks compute), and an export is a request the engine schedules after the prefill running.
    kv_connector: bool = False
    prefilling: Bookings = field(default_factory=Bookings)  # requests whose prefill runs here
    decoding: Bookings = field(default_factory=Bookings)  # requests decoding (or about to) here
    # what other Conductors booked here, as the instance last reported it (live replicas; empty in the simulator)
    foreign_prefilling: Bookings = field(default_factory=Bookings)
    foreign_decoding: Bookings = field(default_factory=Bookings)

    def residents(self, now: float) -> tuple[Resident, ...]:
        """The decode batch: this Conductor's bookings and the other Conductors'."""
        return self.decoding.residents(now) + self.foreign_decoding.residents(now)

    @property
    def booked_blocks(self) -> int:
        """KV blocks the bookings hold, every Conductor's."""
        return self.decoding.num_blocks + self.foreign_decoding.num_blocks

    def t_queue(self, now: float) -> float:
        """Predicted prefill work ahead of a request arriving now: both queues feed the instance's one."""
        return self.prefilling.t_queue(now) + self.foreign_prefilling.t_queue(now)

    def prefill_candidate(
        self,
        prefix_len: int,
        now: float,
        residents: tuple[Resident, ...] | None = None,
        block_hashes: Sequence[Hashable] = (),
        block_size: int = 0,
    ) -> PrefillCandidate:
        """The instance as a prefill candidate for a request of which it caches ``prefix_len`` tokens.

        ``block_hashes`` (the prompt's chained block hashes, of ``block_size`` tokens): the prefix grows to
        what the prefills queued here compute first (``Bookings.queued_prefix``). ``residents``:
        ``self.residents(now)`` when the caller has it already (a colocated instance's two roles).
        """
        cached = prefix_len
        if block_hashes:
            prefix_len = max(prefix_len, self.prefilling.queued_prefix(block_hashes) * block_size)
        cached_len = None if prefix_len == cached else cached
        t_queue = self.t_queue(now)
        profile = self.profile[0] if self.profile else None
        own, foreign = self.prefilling.in_prefill(), self.foreign_prefilling.in_prefill()
        in_flight, queued = own[0] + foreign[0], own[1] + foreign[1]
        idle = not self.prefilling and not self.foreign_prefilling
        if self.role != "colocated":
            t_export = 0.0
            if self.kv_connector and not idle:
                t_export = self.prefilling.t_running(now) + self.foreign_prefilling.t_running(now)
            return PrefillCandidate(
                self.instance_id, prefix_len, t_queue, self.prefill_model,
                chunk_tokens=0 if self.kv_connector else self.chunk_tokens,
                idle=idle, profile=profile, in_flight=in_flight, queued_new_tokens=queued,
                exports_kv=self.exports_kv, cached_len=cached_len, copies_by_request=self.kv_connector,
                t_export=t_export,
            )  # fmt: skip
        if residents is None:
            residents = self.residents(now)
        decoding = [r for r in residents if r.t_join <= 0]
        step = self.decode_model.predict(len(decoding), sum(r.context for r in decoding))
        return PrefillCandidate(
            self.instance_id, prefix_len, t_queue, self.prefill_model, decode_step_s=step,
            step_tokens=self.chunk_tokens, idle=idle and not residents, profile=profile,
            in_flight=in_flight, queued_new_tokens=queued, exports_kv=self.exports_kv, cached_len=cached_len,
        )  # fmt: skip

    def decode_candidate(self, now: float, residents: tuple[Resident, ...] | None = None) -> DecodeCandidate:
        """The instance as a decode candidate (``residents`` as in ``prefill_candidate``)."""
        return DecodeCandidate(
            self.instance_id,
            residents=self.residents(now) if residents is None else residents,
            num_free_blocks=self.num_blocks - self.booked_blocks,
            max_running=self.max_running,
            model=self.decode_model,
            profile=self.profile[1] if self.profile else None,
        )
