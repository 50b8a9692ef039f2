"""The Conductor's decision record: every scheduling decision, as a ``Decision`` message on request, by id.

Kept for the most recent requests (accepted and rejected), so ``kvconductor explain REQUEST_ID`` and
``Conductor.ExplainDecision`` can show the candidates' estimates, the choice and the reason. The message (one
entry per candidate: hundreds in a large cluster) is built only when asked for: explain, a client's
``include_decision``, a recorded span. What happened (``Outcome``) is filled in as the request runs.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict

from kvconductor.v1 import conductor_pb2
from scheduler.candidates import PrefillEstimate
from scheduler.disaggregation import is_local
from scheduler.policy import Plan, Rejection


def _estimate(e: PrefillEstimate) -> dict[str, Any]:
    """The fields a decision shares with each of its candidates: the prefix and the TTFT terms, in ms."""
    times = {"t_queue_ms": e.t_queue, "t_transfer_ms": e.t_transfer, "t_prefill_ms": e.t_prefill, "t_send_ms": e.t_send,
             "t_shared_ms": e.t_shared}  # fmt: skip
    return {"prefix_len": e.prefix_len, "copy_from": e.copy_from} | {k: v * 1e3 for k, v in times.items()}


def _candidate(e: PrefillEstimate) -> conductor_pb2.CandidateEstimate:
    return conductor_pb2.CandidateEstimate(instance_id=e.instance_id, predicted_ttft_ms=e.ttft * 1e3, **_estimate(e))


def to_decision(request_id: str, policy: str, outcome: Plan | Rejection, label: str = "") -> conductor_pb2.Decision:
    """The message form of a plan or a rejection."""
    plan = outcome if isinstance(outcome, Plan) else outcome.plan
    decision = conductor_pb2.Decision(
        request_id=request_id,
        policy=policy,
        rejected=isinstance(outcome, Rejection),
        reason=outcome.reason,
        client_request_id=label,
    )
    if plan is None:
        return decision
    e = plan.prefill
    decision.MergeFrom(
        conductor_pb2.Decision(
            prefill_instance=e.instance_id,
            decode_instance=plan.decode_instance,
            best_len=plan.best_len,
            best_instance=plan.best_instance,
            copy_tokens=e.copy_tokens,
            **_estimate(e),
            predicted_ttft_ms=plan.ttft * 1e3,
            predicted_tbt_ms=plan.tbt * 1e3,
            candidates=[_candidate(c) for c in plan.candidates],
            probe=plan.probe,
            ttft_overhead_ms=plan.ttft_overhead * 1e3,
        )
    )
    if plan.alternative is not None:  # conditional disaggregation: both paths' plans
        decision.path = "local" if is_local(plan) else "remote"
        decision.alternative.CopyFrom(to_decision(request_id, policy, plan.alternative))
    return decision


@dataclass
class DecisionRecord:
    """A decision as the policy made it; ``message()`` is its ``Decision``, built at the first call."""

    request_id: str
    policy: str
    outcome: Plan | Rejection
    label: str = ""  # the client's request id
    observed: conductor_pb2.Outcome = field(default_factory=conductor_pb2.Outcome)  # what happened so far
    _message: conductor_pb2.Decision | None = None

    def message(self) -> conductor_pb2.Decision:
        """The decision with what has happened so far."""
        if self._message is None:
            self._message = to_decision(self.request_id, self.policy, self.outcome, self.label)
        self._message.outcome.CopyFrom(self.observed)
        return self._message


def decision_attributes(decision: conductor_pb2.Decision | None) -> dict[str, str | int | float | bool]:
    """The decision as span attributes (``kvconductor.decision.*``), candidates as JSON."""
    if decision is None:
        return {}
    fields = MessageToDict(decision, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    candidates = fields.pop("candidates", [])
    fields.pop("outcome", None)
    attributes = {f"kvconductor.decision.{k}": v for k, v in fields.items() if isinstance(v, str | int | float | bool)}
    attributes["kvconductor.decision.candidates"] = json.dumps(candidates)
    return attributes


RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-")  # the gateway's response id is one of these + the request id


class DecisionLog:
    """The last ``capacity`` decisions, by the Conductor's request id; a client's label finds its latest one."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._decisions: OrderedDict[str, DecisionRecord] = OrderedDict()
        self._latest: dict[str, str] = {}  # client label -> the Conductor's id of its latest request

    def record(self, decision: DecisionRecord) -> None:
        """Remember a decision (the oldest is forgotten past capacity)."""
        self._decisions[decision.request_id] = decision
        self._decisions.move_to_end(decision.request_id)
        if decision.label:
            self._latest[decision.label] = decision.request_id
        while len(self._decisions) > self.capacity:
            _, old = self._decisions.popitem(last=False)
            if self._latest.get(old.label) == old.request_id:
                del self._latest[old.label]

    def get(self, request_id: str) -> conductor_pb2.Decision | None:
        """The decision for a request id, the id of its OpenAI response or a client's label, if still remembered."""
        keys = [request_id] + [request_id.removeprefix(p) for p in RESPONSE_ID_PREFIXES if request_id.startswith(p)]
        for key in keys:
            decision = self._decisions.get(key) or self._decisions.get(self._latest.get(key, ""))
            if decision is not None:
                return decision.message()
        return None
