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

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.booking import Booking
from scheduler.candidates import RequestShape, Slo
from scheduler.cost_model import LinkModels
from scheduler.disaggregation import choose_path, stalls_past_tbt
from scheduler.instance import InstanceState
from scheduler.output_length import OutputLengths
from scheduler.policy import ConductorPolicy, CopySource, Plan, Rejection, decode_share


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
        hashes, bs = block_hashes, shape.block_size
        if colocated:  # the same instances in both roles: their decode batch computed once each
            batches = {d.instance_id: d.residents(now) for d in decodes}
            prefill = [p.prefill_candidate(prefix_lens.get(p.instance_id, 0), now, batches[p.instance_id], hashes, bs)
                       for p in prefills]  # fmt: skip
            decode = [d.decode_candidate(now, batches[d.instance_id]) for d in decodes]
        else:
            prefill = [p.prefill_candidate(prefix_lens.get(p.instance_id, 0), now, None, hashes, bs) for p in prefills]
            decode = [d.decode_candidate(now) for d in decodes]
        return self.policy.schedule(
            prefill,
            decode,
            shape,
            slo,
            None if colocated else self.links,
            colocated=colocated,
            store=store,
        )

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
        local = self.decide(now, shape, prefix_lens, mixed, mixed, slo, True, None, block_hashes)
        on = {m.instance_id: m for m in mixed}
        if isinstance(local, Plan) and slo.reject:
            why = stalls_past_tbt(local, on[local.decode_instance].decode_candidate(now), slo.max_tbt)
            if why:
                local = Rejection(why, local, "tbt_slo")
        if not prefills:
            return choose_path(self.policy.config, None, local, shape, _no_share)
        remote = self.decide(now, shape, prefix_lens, prefills, mixed, slo, False, store, block_hashes)

        def share(instance_id: str, start: float) -> float:
            return decode_share(on[instance_id].decode_candidate(now), shape, start)

        return choose_path(self.policy.config, remote, local, shape, share)

    @staticmethod
    def book(now: float, request_id: Hashable, plan: Plan, shape: RequestShape, p: InstanceState,
             d: InstanceState, block_hashes: Sequence[Hashable] = ()) -> None:  # fmt: skip
        """Book the request's prefill work on p and its decode footprint (blocks, batch slot) on d.

        The decode footprint lasts ``shape.output_tokens`` (from ``expected_output_tokens``) x the plan's TBT.
        ``block_hashes``: the prompt's full blocks, which p holds once the prefill is done (``decide`` counts
        them for the requests queued behind it).
        """
        n, e, expected_tokens = shape.num_prompt_tokens, plan.prefill, shape.output_tokens
        full = block_hashes[: n // shape.block_size]
        p.prefilling.add(request_id, Booking(now, e.t_prefill, n, 0, new_tokens=n - e.prefix_len, prompt_blocks=full))
        d.decoding.add(request_id, Booking(now, 0.0, n, shape.num_blocks, now + e.ttft, expected_tokens * plan.tbt))

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
