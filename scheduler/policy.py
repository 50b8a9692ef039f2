"""The Conductor's KVCache-centric scheduling: Mooncake (FAST'25) Algorithm 1, SLO admission, baselines.

Pure code over snapshots of the instances, so that the live Conductor and the simulator run the same
decisions. For each prefill instance (``prefix_len`` = prompt tokens it holds, ``best_len`` = the most
any instance holds)::

    if best_len / prefix_len > kv_cache_balancing_threshold:      # infinite when prefix_len == 0
        copy plan:   T_transfer = copy(best_len - prefix_len);  T_prefill = T_prefill(n - best_len, best_len)
    else:
        local plan:  T_transfer = 0;                            T_prefill = T_prefill(n - prefix_len, prefix_len)
    TTFT = T_queue + T_transfer + T_prefill + T_send(prompt KV still unsent at token 0)

Beyond the paper, ``compare_copy_with_recompute`` keeps the copy plan only when it is predicted faster
than recomputing the same blocks. The least TTFT wins. The decode instance is the one whose predicted
TBT with the request added is lowest, among those with free KV blocks for the whole request and a free
slot. Admission rejects a plan whose TTFT or TBT breaks the SLO.

Early rejection (Mooncake arXiv v3, section 7): *plain* judges TBT on the decode batch as it is now;
*prediction* judges it at the moment the request's prefill would finish, counting the requests whose
prefill completes by then and dropping those whose decode will have finished.

Other rules (``scheduler.rules``) choose the prefill instance differently and never copy: the baselines
``round_robin``, ``random``, ``least_loaded`` and ``cache_aware``, and the peers' published rules
``dynamo`` and ``sglang``; decode choice and admission stay the same for all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

from scheduler.candidates import (
    DecodeCandidate,
    PrefillCandidate,
    PrefillEstimate,
    RequestShape,
    Slo,
)
from scheduler.cost_model import LinkModels
from scheduler.rules import RULES, PrefillRule

POLICIES = tuple(RULES)
_instance_id = attrgetter("instance_id")
EARLY_REJECTION = ("prediction", "plain")
DISAGGREGATION = ("cost", "slack", "dynamo", "length")


@dataclass
class PolicyConfig:
    """The policy's knobs, declared once: ``[scheduler]`` (``SchedulerConfig``) and ``SimConfig`` extend this."""

    # "kvcache_centric" (Algorithm 1) or another prefill rule (scheduler/rules.py): "round_robin", "random",
    # "least_loaded", "cache_aware", "dynamo", "sglang".
    policy: str = "kvcache_centric"
    # Plan a KV copy from the best holder to a prefill instance when
    #   best_len / instance.prefix_len > kv_cache_balancing_threshold
    # (an instance with no cached prefix has an infinite ratio). Values <= 1 copy whenever any other
    # instance holds more; 1.2 copies only when the best holder has at least 20% more prefix; inf never
    # copies. The seed's example 0.8 therefore means "copy whenever the best match is longer".
    kv_cache_balancing_threshold: float = 1.2
    # Beyond the paper: keep a copy plan only if it is predicted faster than recomputing those blocks.
    compare_copy_with_recompute: bool = True
    # "prediction": judge TBT on the decode load predicted for when the request's prefill ends;
    # "plain": on the decode load now (Mooncake section 7 shows it oscillates under overload).
    early_rejection: str = "prediction"
    # Where a request prefills when its decode instance could prefill it too (prefill instances beside
    # colocated ones; scheduler/disaggregation.py): "cost" (the cheaper plan within the SLOs), "slack" (the
    # plan that leaves the most room under the SLOs), "dynamo" (Dynamo's thresholds), "length" (locally below
    # local_prefill_max_tokens).
    disaggregation: str = "cost"
    local_prefill_max_tokens: int = 2048
    # A colocated prompt that would push a request decoding there past the TBT SLO on every instance tried waits
    # for the first of those requests to leave and is planned again, while its TTFT SLO still allows (its wait
    # counts in its TTFT); false: it is refused at once (scheduler/core.py ``_decide_local``).
    defer_local_prefill: bool = True
    # Share of the TBT SLO a colocated prompt leaves free for the requests decoding there that it stalls: it is
    # admitted only if their TBTs stay within (1 - local_tbt_headroom) x the SLO (model error, the machine's noise)
    local_tbt_headroom: float = 0.2

    def policy_config(self, **changes: Any) -> PolicyConfig:
        """These knobs alone (a plain ``PolicyConfig``), with ``changes``."""
        return replace(PolicyConfig(**{f.name: getattr(self, f.name) for f in fields(PolicyConfig)}), **changes)


REASON_CANDIDATES = 8  # candidates a decision's reason names (every one is in the decision's candidates)


@dataclass(frozen=True)
class CopySource:
    """Where a prompt's cached prefix can be copied from: the best prefill holder, or the Mooncake Store."""

    instance_id: str  # a prefill instance, or the store service
    prefix_len: int  # tokens of the prompt's leading blocks it holds (whole blocks)
    t_wait: float = 0.0  # seconds before it can export them (``PrefillCandidate.t_export_of``), in T_transfer


@dataclass(frozen=True)
class Plan:
    """Where to run a request, with the numbers behind the choice."""

    prefill: PrefillEstimate
    decode_instance: str
    tbt: float
    best_len: int
    best_instance: str
    candidates: tuple[PrefillEstimate, ...]
    reason: str
    ttft_overhead: float = 0.0
    # The other path's outcome when the request could prefill locally or remotely (scheduler/disaggregation.py).
    alternative: Plan | Rejection | None = None
    # Admitted although the learned models predicted an SLO miss: the instances are idle and their start-up
    # profile says the request alone meets the SLO. Its measurement re-calibrates the models.
    probe: bool = False
    solo: tuple[float, float] | None = None  # (TTFT, TBT) of the request alone under the profile, when idle
    # A local plan's prompt: the highest TBT its chunks leave a request decoding there (0: it stalls none).
    stall_tbt: float = 0.0

    @property
    def ttft(self) -> float:
        """Predicted TTFT as the client sees it: the chosen instance's estimate plus the fixed overhead."""
        return self.prefill.ttft + self.ttft_overhead


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused; ``plan`` holds the best estimate when there was one."""

    reason: str
    plan: Plan | None = None
    kind: str = "capacity"  # "ttft_slo", "tbt_slo" or "capacity" (no instance, no free blocks or slots)
    # > 0: not refused yet; plan it again this many seconds from now, when room is expected (the first request
    # decoding there leaves) and its TTFT SLO still allows (``PolicyConfig.defer_local_prefill``)
    retry_in: float = 0.0


@dataclass
class ConductorPolicy:
    """Chooses (prefill, decode) per request; holds the rule's state (round-robin turn, RNG)."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    rule: PrefillRule = field(init=False)

    def __post_init__(self) -> None:
        if self.config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.config.policy!r}")
        if self.config.early_rejection not in EARLY_REJECTION:
            raise ValueError(f"early_rejection must be one of {', '.join(EARLY_REJECTION)}")
        if self.config.disaggregation not in DISAGGREGATION:
            raise ValueError(f"disaggregation must be one of {', '.join(DISAGGREGATION)}")
        self.rule = RULES[self.config.policy](self.seed)

    def schedule(
        self,
        prefills: Sequence[PrefillCandidate],
        decodes: Sequence[DecodeCandidate],
        request: RequestShape,
        slo: Slo,
        links: LinkModels | None = None,
        colocated: bool = False,
        store: CopySource | None = None,
    ) -> Plan | Rejection:
        """Algorithm 1: pick (prefill, decode) by predicted TTFT and TBT, or reject.

        ``links`` predicts KV transfers: copies between prefill instances and the prompt KV's trip to the
        decode instance. None (the colocated path) means no transfers at all. ``colocated``: each instance
        both prefills and decodes, so the decode instance is the prefill instance, and only instances with
        room for the request are candidates. ``store``: what the Mooncake Store holds of the prompt, one
        more copy source beside the best holder, with its own learned link to each instance.
        """
        if colocated:
            room = {d.instance_id for d in decodes if d.has_room(request)}
            prefills = [p for p in prefills if p.instance_id in room]
        if not prefills:
            return Rejection(f"no instance is available with {request.num_blocks} free KV blocks and a free slot")
        # The holder of the longest usable prefix, ties to the greatest id (usable_prefix is monotonic: one pass of
        # plain ints, then the ties, instead of a key call per candidate); a copy reads what is cached now, so its
        # source is the holder of the longest cached prefix (the same instance unless prompts queued elsewhere
        # will leave a longer one).
        best = _longest(prefills, request, attrgetter("prefix_len"))
        held = best if best.cached_len is None else _longest(prefills, request, attrgetter("cached"))
        holders = [CopySource(held.instance_id, held.cached, held.t_export_of(held.cached, request.block_size))]
        if store is not None and store.prefix_len > 0:
            holders.append(store)
        candidates = [CopySource(best.instance_id, best.prefix_len), *holders[1:]]
        top = max(candidates, key=lambda s: (request.usable_prefix(s.prefix_len), s is not store))  # ties: the instance
        best_len, best_instance = request.usable_prefix(top.prefix_len), top.instance_id
        sources = [s for s in holders if s is store or held.exports_kv]
        can_copy = links is not None and self.rule.copies
        estimates = tuple(self._estimate(p, sources if can_copy else [], request, links) for p in prefills)
        if colocated:
            on = {d.instance_id: d for d in decodes}
            estimates = tuple(
                e.with_shared(shared_delay(e, p, on[e.instance_id], request))
                for e, p in zip(estimates, prefills, strict=True)
            )
        chosen = self.rule.choose(estimates, prefills, request)
        at = chosen.ttft if self.config.early_rejection == "prediction" else 0.0
        decode = select_decode([d for d in decodes if d.instance_id == chosen.instance_id] if colocated else decodes,
                               request, at)  # fmt: skip
        if decode is None:
            return Rejection(f"no decode instance has {request.num_blocks} free KV blocks and a free slot")
        solo = _solo(
            next(p for p in prefills if p.instance_id == chosen.instance_id),
            next(d for d in decodes if d.instance_id == decode[0]),
            chosen,
            request,
        )
        plan = Plan(chosen, decode[0], decode[1], best_len, best_instance, estimates, "", slo.ttft_overhead,
                    solo=solo)  # fmt: skip
        plan = replace(plan, reason=self._explain(plan, store, colocated))
        return admit(plan, slo)

    def _estimate(
        self,
        p: PrefillCandidate,
        sources: Sequence[CopySource],
        request: RequestShape,
        links: LinkModels | None,
    ) -> PrefillEstimate:
        """The estimate for ``p``: computing what it lacks, or first copying it from the fastest source."""
        n = request.num_prompt_tokens
        own = request.usable_prefix(p.prefix_len)
        t_send = (
            0.0 if links is None else links.model(p.instance_id).predict(request.kv_bytes(p.exposed_tokens(n, own)))
        )
        cached = min(own, request.usable_prefix(p.cached))  # the rest of own is left by prompts queued ahead
        queued = own - cached
        local = PrefillEstimate(p.instance_id, own, p.t_queue, 0.0, p.t_prefill(n - own, own), t_send,
                                queued_tokens=queued)  # fmt: skip
        if links is None or not p.exports_kv:
            return local
        chosen = local
        for source in sources:
            best_len = request.usable_prefix(source.prefix_len)
            ratio = math.inf if own == 0 else best_len / own
            if (
                source.instance_id == p.instance_id
                or best_len <= own
                or ratio <= self.config.kv_cache_balancing_threshold
            ):
                continue
            copy_tokens = best_len - cached  # a copy runs before the prompts queued ahead have left their blocks
            copied = replace(
                local,
                prefix_len=best_len,
                t_transfer=source.t_wait
                + links.model(source.instance_id, p.instance_id).predict(request.kv_bytes(copy_tokens))
                + p.t_import(best_len),
                t_prefill=p.t_prefill(n - best_len, best_len),
                t_send=links.model(p.instance_id).predict(request.kv_bytes(p.exposed_tokens(n, best_len))),
                copy_from=source.instance_id,
                copy_tokens=copy_tokens,
                queued_tokens=0,
            )
            if chosen is local or copied.ttft < chosen.ttft:
                chosen = copied
        if self.config.compare_copy_with_recompute and chosen.ttft >= local.ttft:
            return local
        return chosen

    def _explain(self, plan: Plan, store: CopySource | None, colocated: bool) -> str:
        e = plan.prefill
        shown = plan.candidates  # the cheapest few when there are many: the reason is logged for every request
        if len(shown) > REASON_CANDIDATES:
            shown = tuple(sorted(shown, key=attrgetter("cost"))[:REASON_CANDIDATES])
        others = ", ".join(
            f"{c.instance_id}={c.ttft * 1e3:.0f}ms" + (f"+{c.t_shared * 1e3:.0f}ms shared" if c.t_shared else "")
            for c in shown
        ) + (f", {len(plan.candidates) - len(shown)} more" if len(shown) < len(plan.candidates) else "")
        source = f"the Mooncake Store ({e.copy_from})" if store and e.copy_from == store.instance_id else e.copy_from
        how = f"copies {e.copy_tokens} tokens of KV from {source}" if e.copy_from else "computes locally"
        queued = f" ({e.queued_tokens} of them from prompts queued ahead of it there)" if e.queued_tokens else ""
        shared = " plus the decode time it shares" if colocated else ""
        rule = f"{self.rule.explanation.format(shared=shared)} ({others})"
        when = "when its prefill ends" if self.config.early_rejection == "prediction" else "now"
        return (
            f"prefill {e.instance_id} by {rule}; it reuses {e.prefix_len} tokens{queued} and {how}; "
            f"decode {plan.decode_instance} has the lowest predicted TBT {when} ({plan.tbt * 1e3:.1f} ms)"
        )


def _longest(prefills: Sequence[PrefillCandidate], request: RequestShape, length: attrgetter[int]) -> PrefillCandidate:
    """The candidate with the longest usable ``length``, ties to the greatest id."""
    longest = request.usable_prefix(max(length(p) for p in prefills))
    return max((p for p in prefills if request.usable_prefix(length(p)) == longest), key=_instance_id)


def select_decode(decodes: Sequence[DecodeCandidate], request: RequestShape, at: float) -> tuple[str, float] | None:
    """The decode instance with the lowest predicted TBT at time ``at``, or None if none has room."""
    best: tuple[str, float] | None = None
    for d in decodes:
        if not d.has_room(request):
            continue
        tbt = d.predicted_tbt(at, request.num_prompt_tokens)
        if best is None or tbt < best[1]:
            best = (d.instance_id, tbt)
    return best


def shared_delay(e: PrefillEstimate, p: PrefillCandidate, d: DecodeCandidate, request: RequestShape) -> float:
    """A request's cost on a colocated instance beyond its TTFT: its own decode time plus the delay to others.

    Each request decoding there when the prompt runs waits for the prompt's compute (its chunks share the
    steps); then the request's ``decode_share``. Summed, the choice minimises the latency added to everyone
    on the instance, so a prefix holder busy decoding loses to an idle instance once the requests it would
    slow cost more than the prefix saves (variants measured and not kept: docs/design.md).
    """
    n = request.num_prompt_tokens
    stalled = sum(1 for r in d.residents if r.t_join <= e.t_queue < r.t_leave)
    delay = stalled * p.model.predict(n - e.prefix_len, e.prefix_len) if stalled else 0.0
    return delay + decode_share(d, request, e.ttft)


def decode_share(d: DecodeCandidate, request: RequestShape, start: float) -> float:
    """The request's decode on d from ``start``: its own step time plus what it adds to everyone else's.

    For its ``output_tokens`` steps (0 when they are unknown): its step time, plus the step-time increase it
    causes to every request in the batch.
    """
    if request.output_tokens <= 0:
        return 0.0
    n = request.num_prompt_tokens
    if not d.residents:  # an idle instance (most of a large cluster): a batch of one
        return request.output_tokens * d.model.predict(1, n)
    batch = [r for r in d.residents if r.t_join <= start < r.t_leave]
    context = sum(r.context for r in batch)
    before, after = d.model.predict(len(batch), context), d.model.predict(len(batch) + 1, context + n)
    return request.output_tokens * (after + len(batch) * (after - before))


def _solo(
    p: PrefillCandidate, d: DecodeCandidate, estimate: PrefillEstimate, request: RequestShape
) -> tuple[float, float] | None:
    """(TTFT, TBT) of the request alone under the start-up profiles, if both instances are idle."""
    if not (p.idle and not d.residents and p.profile is not None and d.profile is not None):
        return None
    new = request.num_prompt_tokens - estimate.prefix_len
    ttft = estimate.t_transfer + p.profile.predict(new, estimate.prefix_len) + estimate.t_send
    return ttft, d.profile.predict(1, request.num_prompt_tokens)


def admit(plan: Plan, slo: Slo) -> Plan | Rejection:
    """Reject a plan that breaks the TTFT or TBT SLO (when the operator asks for rejection).

    Admission cannot lock itself out: models learned under contention may predict a miss even on an
    idle cluster, and a cluster that rejects everything measures nothing that would correct them. So
    when the chosen instances are idle, the request is admitted as a *probe* unless the request alone,
    under the instances' start-up profiles, would break the SLO.
    """
    if not slo.reject:
        return plan
    miss = ""
    if plan.ttft > slo.max_ttft:
        miss = f"predicted TTFT {plan.ttft * 1e3:.0f} ms exceeds the SLO of {slo.max_ttft * 1e3:.0f} ms"
        kind = "ttft_slo"
    elif plan.tbt > slo.max_tbt:
        miss = f"predicted TBT {plan.tbt * 1e3:.1f} ms exceeds the SLO of {slo.max_tbt * 1e3:.0f} ms"
        kind = "tbt_slo"
    if not miss:
        return plan
    if plan.solo is not None and plan.solo[0] <= slo.max_ttft and plan.solo[1] <= slo.max_tbt:
        ttft, tbt = plan.solo
        note = f"; {miss}, but the instances are idle and their profile predicts TTFT {ttft * 1e3:.0f} ms, "
        return replace(plan, probe=True, reason=plan.reason + note + f"TBT {tbt * 1e3:.1f} ms: admitted as a probe")
    return Rejection(miss, plan, kind)
