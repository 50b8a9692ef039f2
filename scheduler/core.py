"""The Conductor core: candidates -> decide -> book -> observe, shared by the live Conductor and the simulator.

Per request::

    decide(now, shape, prefix_lens, prefills, decodes, slo, colocated)  -> Plan or Rejection (Algorithm 1)
    decide_conditional(...)  the same, where the decode instances may prefill too: remote or local, by cost
    book(now, request_id, plan, ...)        the prefill work on p, the decode footprint on d
    prefill_done / decode_started / decode_progress / release as the request runs
    observe_completion(tokens)              the output lengths that size future decode bookings

On the colocated path the decode instance is the prefill instance the policy chose, with room for the
request, and the booking goes to that same instance (``Plan.decode_instance``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.booking import Booking
from scheduler.candidates import RequestShape, Resident, Slo
from scheduler.cost_model import LinkModels
from scheduler.disaggregation import Queued, choose_path, stalled_by_queued_prompts, stalls_past_tbt
from scheduler.instance import InstanceState
from scheduler.output_length import OutputLengths
from scheduler.policy import ConductorPolicy, CopySource, Plan, Rejection, decode_share
from scheduler.stalls import prompt_stalls

LOCAL_RETRIES = 2  # colocated instances skipped per request for stalling their decodes, before a refusal
# A deferred prompt is planned again at most this often: a request the models say is overdue leaves at some step's
# end, and re-planning the prompt at every step until it does costs the Conductor more than the wait gains.
DEFER_MIN_S = 0.1


@dataclass
class ConductorCore:
    """The policy, the learned transfer links and the bookkeeping around them."""

    policy: ConductorPolicy
    links: LinkModels
    output_lengths: OutputLengths = field(default_factory=OutputLengths)  # of the completions seen lately

    def decide(
        self,
        now: float,
        shape: RequestShape,
        prefix_lens: Mapping[str, int],
        prefills: Sequence[InstanceState],
        decodes: Sequence[InstanceState],
        slo: Slo,
        colocated: bool,
        store: CopySource | None = None,
        block_hashes: Sequence[Hashable] = (),
    ) -> Plan | Rejection:
        """Algorithm 1 over the instances as they are now.

        ``prefix_lens``: cached tokens per instance; ``store``: what the Mooncake Store holds of the prompt;
        ``block_hashes``: the prompt's chained hashes of ``shape.block_size``-token blocks, matched against the
        prompts queued on each instance (the prefix it will hold when the request runs there).
        """
        if colocated:
            return self._decide_local(now, shape, prefix_lens, decodes, slo, block_hashes)
        hashes, bs = block_hashes, shape.block_size
        prefill = [p.prefill_candidate(prefix_lens.get(p.instance_id, 0), now, None, hashes, bs) for p in prefills]
        decode = [d.decode_candidate(now) for d in decodes]
        return self.policy.schedule(prefill, decode, shape, slo, self.links, store=store)

    def _decide_local(
        self,
        now: float,
        shape: RequestShape,
        prefix_lens: Mapping[str, int],
        pool: Sequence[InstanceState],
        slo: Slo,
        block_hashes: Sequence[Hashable],
    ) -> Plan | Rejection:
        """Algorithm 1 over colocated instances (both roles: their decode batches are computed once each).

        The cost of each instance already counts the stall its prompt's chunks impose on the requests decoding
        there (``policy.shared_delay``). With SLO admission, a plan whose prompt would push requests decoding
        there past the TBT SLO (``stalls_past_tbt``) is re-planned without that instance, ``LOCAL_RETRIES`` times
        at most, and refused when every plan tried pushes some: a request pushed past the SLO is a miss as much
        as a refused one, and the prompt would push it after it was admitted (docs/design.md). The refusal is
        deferred (``Rejection.retry_in``) when the TTFT SLO leaves time to wait for the first request decoding on
        those instances to leave: its steps and the stalls it absorbs go with it.
        """
        hashes, bs = block_hashes, shape.block_size
        skipped: list[tuple[str, str]] = []  # (instance, why)
        room_in = math.inf  # when the first request decoding on a skipped instance leaves
        fewest: tuple[int, Plan] | None = None  # the plan pushing the fewest past the SLO
        batches = {m.instance_id: m.residents(now) for m in pool}
        prefill = [m.prefill_candidate(prefix_lens.get(m.instance_id, 0), now, batches[m.instance_id], hashes, bs)
                   for m in pool]  # fmt: skip
        decode = [m.decode_candidate(now, batches[m.instance_id]) for m in pool]
        left = list(range(len(pool)))  # the instances not skipped yet (their candidates do not change)
        headroom = self.policy.config.local_tbt_headroom  # of the TBT SLO, for the requests its prompt stalls
        for _ in range(LOCAL_RETRIES + 1):
            plan = self.policy.schedule([prefill[i] for i in left], [decode[i] for i in left], shape, slo, None,
                                        colocated=True)  # fmt: skip
            if not isinstance(plan, Plan) or not slo.reject:
                break
            at = next(i for i in left if pool[i].instance_id == plan.decode_instance)
            chunks = _chunks(shape.num_prompt_tokens - plan.prefill.prefix_len, pool[at].chunk_tokens)
            pushed, why, highest = stalls_past_tbt(plan, decode[at], slo.max_tbt, chunks, headroom)
            if not pushed:
                notes = (f"; {why}" if why else "") + "".join(f"; not {i}: {w}" for i, w in skipped)
                return replace(plan, reason=plan.reason + notes, stall_tbt=highest)
            skipped.append((plan.decode_instance, why))
            room_in = min(room_in, _next_leave(batches[plan.decode_instance], prefill[at].decode_step_s))
            if fewest is None or pushed < fewest[0]:
                fewest = (pushed, plan)
            left.remove(at)
            if not left:
                break
        if fewest is None:  # nothing weighed: the policy's outcome as it is
            return plan
        reason = skipped[0][1] if len(skipped) == 1 else "; ".join(f"on {i}: {w}" for i, w in skipped)
        defer = self.policy.config.defer_local_prefill and fewest[1].ttft + room_in <= slo.max_ttft
        return Rejection(reason, fewest[1], "tbt_slo", retry_in=room_in if defer else 0.0)

    def decide_conditional(
        self,
        now: float,
        shape: RequestShape,
        prefix_lens: Mapping[str, int],
        prefills: Sequence[InstanceState],
        mixed: Sequence[InstanceState],
        slo: Slo,
        store: CopySource | None = None,
        block_hashes: Sequence[Hashable] = (),
    ) -> Plan | Rejection:
        """Prefill remotely (on ``prefills``, decode on ``mixed``) or locally (on ``mixed``).

        The two plans of Algorithm 1, compared by the ``disaggregation`` rule (``scheduler/disaggregation.py``).
        """
        local = self._decide_local(now, shape, prefix_lens, mixed, slo, block_hashes)
        on = {m.instance_id: m for m in mixed}
        if not prefills:
            return choose_path(self.policy.config, None, local, shape, _no_share, slo)
        remote = self.decide(now, shape, prefix_lens, prefills, mixed, slo, False, store, block_hashes)

        def stalled(plan: Plan, m: InstanceState) -> str:
            return stalled_by_queued_prompts(plan, m.decode_candidate(now), _queued(m, now), shape, slo.max_tbt)

        if isinstance(remote, Plan) and slo.reject and (why := stalled(remote, on[remote.decode_instance])):
            calm = [m for m in mixed if not stalled(remote, m)]  # decode where no queued prompt stalls it
            again = calm and self.decide(now, shape, prefix_lens, prefills, calm, slo, False, store, block_hashes)
            remote = again if isinstance(again, Plan) else Rejection(why, remote, "tbt_slo")

        def share(instance_id: str, start: float) -> float:
            return decode_share(on[instance_id].decode_candidate(now), shape, start)

        return choose_path(self.policy.config, remote, local, shape, share, slo)

    @staticmethod
    def book(now: float, request_id: Hashable, plan: Plan, shape: RequestShape, p: InstanceState,
             d: InstanceState, block_hashes: Sequence[Hashable] = ()) -> None:  # fmt: skip
        """Book the request's prefill work on p and its decode footprint (blocks, batch slot) on d.

        The decode footprint lasts ``shape.output_tokens`` (from ``expected_output_tokens``) x the plan's TBT.
        ``block_hashes``: the prompt's full blocks, which p holds once the prefill is done (``decide`` counts
        them for the requests queued behind it). On a colocated d the steps that prompts prefilled there stall
        are booked on the requests decoding there (``Booking.stalls``): a prompt prefilled on d stalls those
        decoding while it runs, and a request prefilled elsewhere is stalled by the prompts queued on d.
        """
        n, e, expected_tokens = shape.num_prompt_tokens, plan.prefill, shape.output_tokens
        decode = Booking(now, 0.0, n, shape.num_blocks, now + e.ttft, expected_tokens * plan.tbt)
        if d.role == "colocated":
            if p is d:
                bookings = list(d.decoding.items.values())
                residents = [b.resident(now) for b in bookings]
                chunks = _chunks(n - e.prefix_len, d.chunk_tokens)
                for i, hit, stall, _ in prompt_stalls(residents, d.decode_model, e.t_queue, e.t_prefill, chunks):
                    bookings[i].stalls = (*bookings[i].stalls, (hit, stall))
                    bookings[i].expected_decode_s += hit * stall  # it decodes that much longer
            elif (queued := _queued(d, now)).chunks:
                hit, stall = queued.stalls(e.ttft, expected_tokens)
                decode.stalls = ((hit, stall),)
                decode.expected_decode_s += hit * stall
        full = block_hashes[: n // shape.block_size]
        p.prefilling.add(request_id, Booking(now, e.t_prefill, n, 0, new_tokens=n - e.prefix_len, prompt_blocks=full))
        d.decoding.add(request_id, decode)

    def expected_output_tokens(self, max_tokens: int, fixed: bool = False, produced: int = 0) -> int:
        """Completion tokens a request allowed ``max_tokens`` that has ``produced`` is expected to produce.

        ``fixed``: nothing can end it before ``max_tokens`` (``ignore_eos``, no stop tokens or strings), so
        it produces exactly that many; otherwise what the completions seen lately say (``OutputLengths``).
        """
        return max_tokens if fixed else self.output_lengths.expected(max_tokens, produced)

    @staticmethod
    def prefill_done(p: InstanceState, request_id: Hashable, now: float) -> None:
        """The request's prefill finished (or failed): the next one on p starts now."""
        p.prefilling.prefill_done(request_id, now)

    @staticmethod
    def decode_started(d: InstanceState, request_id: Hashable, now: float) -> None:
        """The request's first token is out: it decodes on d from now."""
        booking = d.decoding.items.get(request_id)
        if booking is not None and booking.decode_started is None:
            booking.decode_started = now

    def decode_progress(
        self, d: InstanceState, request_id: Hashable, now: float, tokens_out: int, max_tokens: int, fixed: bool
    ) -> None:
        """``tokens_out`` of the request's output tokens are out (the live Conductor, as they stream)."""
        booking = d.decoding.items.get(request_id)
        if booking is not None:
            booking.progress(now, tokens_out, self.expected_output_tokens(max_tokens, fixed, tokens_out))

    @staticmethod
    def release(request_id: Hashable, now: float, *instances: InstanceState) -> None:
        """Forget the request on the instances (finished, failed or cancelled)."""
        for v in instances:
            v.prefilling.remove(request_id, now)
            v.decoding.remove(request_id, now)

    def observe_completion(self, completion_tokens: int) -> None:
        """A request finished with this many tokens."""
        self.output_lengths.observe(completion_tokens)


def _no_share(instance_id: str, start: float) -> float:
    return 0.0


def _next_leave(residents: Sequence[Resident], step: float) -> float:
    """Seconds until the first of ``residents`` is expected to leave; a step and ``DEFER_MIN_S`` from now at least."""
    return max(min((r.t_leave for r in residents), default=math.inf), step, DEFER_MIN_S)


def _queued(m: InstanceState, now: float) -> Queued:
    """The prompts queued to prefill on a colocated instance."""
    waiting, tokens = m.prefilling.in_prefill()
    return Queued(m.t_queue(now), max(waiting, _chunks(tokens, m.chunk_tokens)))


def _chunks(new_tokens: int, chunk_tokens: int) -> int:
    """Engine steps a prompt's ``new_tokens`` take in chunks of ``chunk_tokens`` (0: one step)."""
    return math.ceil(new_tokens / chunk_tokens) if chunk_tokens > 0 else min(1, new_tokens)
