"""Conditional disaggregation: each request prefills on its decode instance or on a prefill instance.

In a mixed deployment (prefill instances beside colocated ones, which decode and can prefill too) every
request has two plans, both from Algorithm 1 (``ConductorCore.decide_conditional``):

* **remote**: a prefill instance (copies included) with a colocated instance as the decode instance. Its
  cost: its TTFT, plus its ``decode_share`` on the decode instance (its own decode time and the step
  time it adds to every request decoding there).
* **local**: a colocated instance prefills and decodes. Its cost: its TTFT there, plus the same decode
  share, plus the stall its prompt's chunks add to every request decoding there (``shared_delay``).

Each plan is admitted on its own (SLOs, free blocks). A prompt prefilled on a colocated instance stalls every
request decoding there for as many steps as it has chunks, and a request's TBT (the mean of its longest 10%
of gaps) feels them: a local plan is admitted only if its chunks keep those requests within the TBT SLO
(``stalls_past_tbt``; the remote plan pushes no one), and a remote plan decodes only where the prompts queued
to prefill keep the request itself within it (``stalled_by_queued_prompts``). ``[scheduler] disaggregation`` chooses:

* ``cost``: the cheaper admitted plan; a rejection only when neither is admitted. No threshold: a short
  prompt goes remote when the colocated instances are busy decoding, a long one stays local when its
  prefix is cached there and the prefill pool is queued.
* ``slack``: of two admitted plans, the one that leaves the most room under the SLOs: the smaller of its
  TTFT's share of the TTFT SLO and its TBT's of the TBT SLO, where a local plan's TBT is also that of the
  requests its prompt stalls (``Plan.stall_tbt``). A local prompt that keeps the requests decoding there just
  within the TBT SLO loses to a remote plan queued a few seconds under a TTFT SLO of ten: model error and
  the machine's noise push the former over, not the latter. A rejection only when neither is admitted.
* ``dynamo``: Dynamo's conditional disaggregation, as its router decides: local when the part of the
  prompt not cached on the decode instance is under 2,048 tokens and under 70% of the prompt, or when every
  prefill instance has work queued; remote otherwise.
* ``length``: local when the prompt is shorter than ``local_prefill_max_tokens``.

The threshold rules take the plan they pick, admitted or not, as a router would. Whichever path wins, the
plan carries the other one (``Plan.alternative``) so that ``explain`` shows both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from scheduler.candidates import DecodeCandidate, RequestShape, Slo
from scheduler.policy import Plan, PolicyConfig, Rejection
from scheduler.stalls import chunks_after, resident_tbts, tbt_with_stalls

DYNAMO_MAX_LOCAL_TOKENS = 2048  # uncached tokens below which Dynamo prefills on the decode worker
DYNAMO_MAX_LOCAL_SHARE = 0.7  # ... when they are also below this share of the prompt

# The decode share of a request on a decode instance from a time: (instance id, start) -> seconds.
DecodeShare = Callable[[str, float], float]


def is_local(plan: Plan) -> bool:
    """Whether the plan prefills on its decode instance."""
    return plan.prefill.instance_id == plan.decode_instance


@dataclass(frozen=True, slots=True)
class Queued:
    """The prompts queued to prefill on a colocated instance: ``seconds`` of work from now, in ``chunks`` steps."""

    seconds: float = 0.0
    chunks: int = 0

    def stalls(self, start: float, tokens: int) -> tuple[int, float]:
        """(steps they stall of a request decoding ``tokens`` tokens from ``start``, how much longer each is).

        The request takes a chunk with each of its steps while they last (``stalls.chunks_after``).
        """
        if self.chunks <= 0 or self.seconds <= 0:
            return 0, 0.0
        return min(chunks_after(self.chunks, 0.0, self.seconds, start), tokens), self.seconds / self.chunks


def stalls_past_tbt(plan: Plan, d: DecodeCandidate, max_tbt: float, chunks: int,
                    headroom: float = 0.0) -> tuple[int, str, float]:  # fmt: skip
    """What prefilling locally does to the requests decoding on d: (how many it pushes past the TBT SLO, why, top).

    Past the SLO here is past ``max_tbt`` less ``headroom``, the share of it a local prompt leaves free
    (``PolicyConfig.local_tbt_headroom``).

    ``top``: the highest TBT it leaves a request within the SLO (0 when it keeps none there). The prompt's compute
    comes in ``chunks`` engine steps, each a gap longer by its share of the compute, for every request decoding
    there while they run (``stalls.resident_tbts``). A request already past the SLO is not counted again. The text
    says how far the stalled requests' TBTs go ("" when the prompt stalls none), so that ``explain`` shows how close
    an admitted local plan came to the SLO.
    """
    e = plan.prefill
    tbts = list(resident_tbts(d, e.t_queue, e.t_prefill, chunks))
    if not tbts:
        return 0, "", 0.0
    slo = f"the TBT SLO of {max_tbt * 1e3:.0f} ms" + (f" less its {headroom:.0%} headroom" if headroom else "")
    max_tbt *= 1 - headroom
    pushed = [after for before, after in tbts if before <= max_tbt < after]
    compute = f"its prompt's {e.t_prefill * 1e3:.0f} ms of compute in {max(1, chunks)} steps"
    kept = [after for _, after in tbts if after <= max_tbt]  # the others were past the SLO before it
    highest = max(kept, default=0.0)
    if pushed:
        why = (f"{compute} would push {_requests(len(pushed))} decoding there to a TBT of up to "
               f"{max(pushed) * 1e3:.0f} ms, over {slo}")  # fmt: skip
        return len(pushed), why, highest
    past = f"{_requests(len(tbts) - len(kept))} already past the TBT SLO"
    if not kept:
        return 0, f"{compute} stalls only {past}", highest
    within = f"{compute} keeps {_requests(len(kept))} decoding there within {slo} (up to {highest * 1e3:.0f} ms)"
    return 0, within + (f"; it stalls {past}" if len(kept) < len(tbts) else ""), highest


def _requests(n: int) -> str:
    return "a request" if n == 1 else f"{n} requests"


def stalled_by_queued_prompts(plan: Plan, d: DecodeCandidate, queued: Queued, request: RequestShape,
                              max_tbt: float) -> str:  # fmt: skip
    """Why decoding on d (a colocated instance) would break the request's own TBT SLO ("" when it would not).

    The ``queued`` prompts' steps are each a gap longer by its share of their compute, for every request
    decoding there while they run: this one from its TTFT on.
    """
    if queued.chunks <= 0:
        return ""
    start = plan.prefill.ttft
    step = d.predicted_tbt(start, request.num_prompt_tokens)
    tokens = max(1, request.output_tokens)
    tbt = tbt_with_stalls(step, tokens, [queued.stalls(start, tokens)])
    if tbt <= max_tbt:
        return ""
    return (f"the {queued.seconds * 1e3:.0f} ms of prompts queued to prefill on {d.instance_id} would stall its "
            f"decode to a TBT of {tbt * 1e3:.0f} ms, over the SLO of {max_tbt * 1e3:.0f} ms")  # fmt: skip


def path_cost(plan: Plan, decode_share: DecodeShare) -> float:
    """What the request costs everyone on this path: TTFT, the decode share, and a local prompt's stall."""
    if is_local(plan):
        return plan.prefill.cost  # TTFT + shared_delay (the stall and the decode share)
    return plan.prefill.ttft + decode_share(plan.decode_instance, plan.prefill.ttft)


def choose_path(
    config: PolicyConfig,
    remote: Plan | Rejection | None,
    local: Plan | Rejection,
    request: RequestShape,
    decode_share: DecodeShare,
    slo: Slo,
) -> Plan | Rejection:
    """The plan the ``config.disaggregation`` rule takes (``remote`` None: no prefill instance is available)."""
    if remote is None:
        return local
    if config.disaggregation == "cost":
        return _cheaper(remote, local, lambda plan: path_cost(plan, decode_share), "cost", "ms")
    if config.disaggregation == "slack":
        return _cheaper(remote, local, lambda plan: -slo_slack(plan, slo), "room under the SLOs", "%")
    go_local = _threshold_local(config, remote, local, request)
    chosen, other = (local, remote) if go_local else (remote, local)
    rule = "Dynamo's rule" if config.disaggregation == "dynamo" else f"below {config.local_prefill_max_tokens} tokens"
    why = f"prefills {'on its decode instance' if go_local else 'on a prefill instance'} by {rule}"
    return _with(chosen, other, why)


def slo_slack(plan: Plan, slo: Slo) -> float:
    """The room a plan leaves under the SLOs: the smaller of 1 - TTFT / its SLO and 1 - TBT / its SLO.

    Its TBT is the larger of the request's own and the highest it leaves a request its prompt stalls.
    """
    return min(1 - plan.ttft / slo.max_ttft, 1 - max(plan.tbt, plan.stall_tbt) / slo.max_tbt)


def _cheaper(remote: Plan | Rejection, local: Plan | Rejection, cost: Callable[[Plan], float], what: str,
             unit: str) -> Plan | Rejection:  # fmt: skip
    """The admitted plan of lower ``cost`` (named ``what``: ms of cost, or % of room when ``unit`` is "%")."""
    if isinstance(remote, Rejection) and isinstance(local, Rejection):
        why = f"neither path meets the SLOs: remote: {remote.reason}; local: {local.reason}"
        kind = local.kind if remote.kind == "capacity" else remote.kind
        return Rejection(why, remote.plan or local.plan, kind, local.retry_in)  # room may come locally
    if isinstance(local, Rejection):
        assert isinstance(remote, Plan)
        return _with(remote, local, f"prefills on a prefill instance: locally {local.reason}")
    if isinstance(remote, Rejection):
        return _with(local, remote, f"prefills on its decode instance: remotely {remote.reason}")
    costs = cost(remote), cost(local)
    chosen, other = (local, remote) if costs[1] < costs[0] else (remote, local)
    mine, theirs = (costs[1], costs[0]) if chosen is local else costs
    where = "on its decode instance" if chosen is local else "on a prefill instance"
    if unit == "%":  # room: the larger wins
        why = f"prefills {where}: {what} {-mine:.0%} against {-theirs:.0%} the other way"
    else:
        why = f"prefills {where}: {what} {mine * 1e3:.0f} ms against {theirs * 1e3:.0f} ms the other way"
    return _with(chosen, other, why)


def _threshold_local(config: PolicyConfig, remote: Plan | Rejection, local: Plan | Rejection,
                     request: RequestShape) -> bool:  # fmt: skip
    n = request.num_prompt_tokens
    if config.disaggregation == "length":
        return n < config.local_prefill_max_tokens
    cached = local.prefill.prefix_len if isinstance(local, Plan) else 0
    uncached = n - cached
    if uncached < DYNAMO_MAX_LOCAL_TOKENS and uncached < DYNAMO_MAX_LOCAL_SHARE * n:
        return True
    remote_plan = remote if isinstance(remote, Plan) else remote.plan
    return remote_plan is not None and all(c.t_queue > 0 for c in remote_plan.candidates)  # the pool is busy


def _with(chosen: Plan | Rejection, other: Plan | Rejection, why: str) -> Plan | Rejection:
    if isinstance(chosen, Rejection):
        return replace(chosen, reason=f"{chosen.reason} ({why})")
    return replace(chosen, alternative=other, reason=f"{chosen.reason}; {why}")
