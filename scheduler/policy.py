"""The Conductor's KVCache-centric scheduling: Mooncake (FAST'25) Algorithm 1 and SLO admission.

Pure functions over snapshots of the instances, so that the live Conductor and an offline simulator
run the same code. For each prefill instance the predicted TTFT is::

    TTFT = T_queue + T_prefill(prompt - prefix_len, prefix_len) + T_send(prompt KV to decode)

and the instance with the least TTFT wins. The decode instance is the one with the lowest predicted
TBT once the request joins its batch, among those with enough free KV blocks and a free slot. A plan
whose TTFT or TBT breaks the SLO is rejected (when the operator asks for rejection).

KV copy between prefill instances (the ``kv_cache_balancing_threshold`` branch of Algorithm 1) is not
planned yet: every instance computes what it does not hold itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.cost_model import DecodeModel, PrefillModel, TransferModel


@dataclass(frozen=True)
class PrefillCandidate:
    """A prefill (or colocated) instance as the Conductor sees it for one request."""

    instance_id: str
    prefix_len: int  # prompt tokens whose KV this instance holds (whole blocks)
    t_queue: float  # seconds of prefill work queued ahead of the request
    model: PrefillModel


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode (or colocated) instance's load."""

    instance_id: str
    num_running: int  # requests in its batch
    total_context: int  # tokens those requests attend to
    num_free_blocks: int
    max_running: int  # max_concurrent_requests
    model: DecodeModel


@dataclass(frozen=True)
class RequestShape:
    """What the policy needs to know about a request."""

    num_prompt_tokens: int
    num_blocks: int  # KV blocks the decode instance must reserve (prompt + max_tokens)
    kv_bytes: int  # bytes of the prompt's KV sent from prefill to decode


@dataclass(frozen=True)
class Slo:
    """Service-level objectives, seconds."""

    max_ttft: float
    max_tbt: float
    reject: bool = True


@dataclass(frozen=True)
class PrefillEstimate:
    """Algorithm 1's estimates for one prefill candidate."""

    instance_id: str
    prefix_len: int
    t_queue: float
    t_prefill: float
    t_send: float

    @property
    def ttft(self) -> float:
        """Predicted time to first token."""
        return self.t_queue + self.t_prefill + self.t_send


@dataclass(frozen=True)
class Plan:
    """Where to run a request, with the numbers behind the choice."""

    prefill: PrefillEstimate
    decode_instance: str
    tbt: float
    best_len: int
    best_instance: str
    candidates: tuple[PrefillEstimate, ...]


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused; ``plan`` holds the best estimate when there was one."""

    reason: str
    plan: Plan | None = None


def estimate_prefill(candidate: PrefillCandidate, request: RequestShape, send: TransferModel | None) -> PrefillEstimate:
    """T_queue, T_prefill and T_send of running the request on one prefill candidate."""
    prefix_len = min(candidate.prefix_len, request.num_prompt_tokens - 1)
    t_prefill = candidate.model.predict(request.num_prompt_tokens - prefix_len, prefix_len)
    t_send = send.predict(request.kv_bytes) if send is not None else 0.0
    return PrefillEstimate(candidate.instance_id, prefix_len, candidate.t_queue, t_prefill, t_send)


def select_decode(decodes: Sequence[DecodeCandidate], request: RequestShape) -> tuple[str, float] | None:
    """The decode instance with the lowest predicted TBT once the request joins, or None if none fits."""
    best: tuple[str, float] | None = None
    for d in decodes:
        if d.num_free_blocks < request.num_blocks or d.num_running >= d.max_running:
            continue
        tbt = d.model.predict(d.num_running + 1, d.total_context + request.num_prompt_tokens)
        if best is None or tbt < best[1]:
            best = (d.instance_id, tbt)
    return best


def schedule(
    prefills: Sequence[PrefillCandidate],
    decodes: Sequence[DecodeCandidate],
    request: RequestShape,
    slo: Slo,
    send: TransferModel | None,
) -> Plan | Rejection:
    """Algorithm 1: pick (prefill, decode) by predicted TTFT and TBT, or reject."""
    if not prefills:
        return Rejection("no prefill instance is available")
    estimates = tuple(estimate_prefill(p, request, send) for p in prefills)
    chosen = min(estimates, key=lambda e: (e.ttft, -e.prefix_len, e.instance_id))
    best = max(prefills, key=lambda p: (p.prefix_len, p.instance_id == chosen.instance_id))
    decode = select_decode(decodes, request)
    if decode is None:
        return Rejection(f"no decode instance has {request.num_blocks} free KV blocks and a free slot")
    plan = Plan(chosen, decode[0], decode[1], best.prefix_len, best.instance_id, estimates)
    if slo.reject and chosen.ttft > slo.max_ttft:
        return Rejection(
            f"predicted TTFT {chosen.ttft * 1e3:.0f} ms exceeds the SLO of {slo.max_ttft * 1e3:.0f} ms", plan
        )
    if slo.reject and plan.tbt > slo.max_tbt:
        return Rejection(f"predicted TBT {plan.tbt * 1e3:.1f} ms exceeds the SLO of {slo.max_tbt * 1e3:.0f} ms", plan)
    return plan
