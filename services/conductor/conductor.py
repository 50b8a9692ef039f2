"""The Conductor: the global scheduler and the public ``Generate`` API.

Per request: tokenize -> chained block hashes -> prefix match per instance (on the Conductor's replica of
kvmeta's index, services/conductor/kv_replica.py) -> Algorithm 1
(``scheduler.policy``) -> reserve on the decode instance -> prefill (its KV goes straight into the
reserved blocks) -> relay token 0 and the decode stream, detokenized, with stop strings, usage and
the decision. On the colocated path one instance does both. Cancelling the call cancels the
downstream calls, which free their KV.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar

import grpc
from opentelemetry import trace
from tokenizers import Tokenizer

from engine.block_hash import packed_block_hashes, packed_token_ids
from engine.tokenizer import TooManyTokens, tokenize_off_loop, too_long
from kvconductor.v1 import (
    colocated_pb2,
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    decode_pb2,
    prefill_pb2,
    worker_pb2,
)
from scheduler.booking import request_blocks
from scheduler.candidates import RequestShape, Slo
from scheduler.core import ConductorCore
from scheduler.cost_model import LinkModels, TransferModel
from scheduler.disaggregation import is_local
from scheduler.policy import ConductorPolicy, CopySource, Plan, Rejection
from scheduler.sim.metrics import request_tbt
from scheduler.ttft_overhead import TtftOverhead
from services.common import metrics
from services.common.config import Config, WorkerConfig
from services.common.instance_record import WorkerRecord
from services.common.rpc import KV_TRANSFER_FAILED, RpcError, Service
from services.common.tasks import spawn
from services.common.telemetry import tracer
from services.conductor.cluster_view import ClusterView, InstanceView
from services.conductor.decisions import DecisionLog, DecisionRecord, decision_attributes
from services.conductor.detokenizer import Detokenizer
from services.conductor.job import RETRYABLE, Job, Piece, WorkerFailure, blame
from services.conductor.kv_replica import KVReplica
from services.conductor.limits import check_limits
from services.conductor.prediction_errors import DEFAULT_WINDOW_S, PredictionErrors
from services.conductor.shared_load import Overcommit, SharedLoad, booking_message

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_AHEAD = 8  # messages of a worker's stream read ahead of the relay
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
OVERHEAD_CAP = 0.25  # the learned TTFT overhead is at most this share of the TTFT SLO


def rejection_error(rejection: Rejection, config: Config, colocated: bool) -> RpcError:
    """RESOURCE_EXHAUSTED that names the SLO's key and what would help.

    Trailing metadata: ``kvconductor-rejection`` (the kind: ttft_slo, tbt_slo, capacity) and, when waiting
    would help (without T_queue the request meets the TTFT SLO), ``retry-after`` in seconds: how far the
    queue puts it past the SLO.
    """
    metadata = [("kvconductor-rejection", rejection.kind)]
    plan, advice = rejection.plan, ""
    if rejection.kind in ("ttft_slo", "tbt_slo"):
        ttft = rejection.kind == "ttft_slo"
        pool = "colocated" if colocated else ("prefill" if ttft else "decode")
        key = "max_ttft_ms" if ttft else "max_tbt_ms"
        slo_ms = float(getattr(getattr(config, pool), key))
        advice = f"; the SLO is [{pool}] {key} = {slo_ms:g}"
        if ttft and plan is not None:
            alone = plan.ttft - plan.prefill.t_queue
            if alone * 1e3 <= slo_ms:
                metadata.append(("retry-after", str(max(1, math.ceil(plan.ttft - slo_ms / 1e3)))))
                advice += f"; without the queue ahead of it {alone * 1e3:.0f} ms: retry when it drains"
            else:
                advice += f"; even on an idle instance it takes {alone * 1e3:.0f} ms: raise the SLO or shorten it"
        advice += f"; more {pool} workers raise the capacity"
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected: {rejection.reason}{advice}", tuple(metadata))


class ConductorServicer(conductor_pb2_grpc.ConductorServicer):
    """``Conductor.Generate``, ``ExplainDecision`` and ``GetStatus``."""

    def __init__(
        self, config: Config, view: ClusterView, tokenizer: Tokenizer, conductor_id: str = "conductor-0"
    ) -> None:
        self.config = config
        self.view = view
        self.tokenizer = tokenizer
        self.conductor_id = conductor_id  # its instance id: the workers tell the other replicas what it booked
        self.core = ConductorCore(
            ConductorPolicy(config.scheduler.policy_config()),
            LinkModels(TransferModel.from_gbps(config.cluster.transfer_bandwidth_gbps)),
        )
        self.shared = SharedLoad(view, conductor_id, self.core.expected_output_tokens)
        self.kv = KVReplica(view)
        self.decisions = DecisionLog()
        self.errors = PredictionErrors()
        self.rejections: collections.Counter[str] = collections.Counter()  # by kind, since start
        # time outside the instances' models, per serving path (scheduler/ttft_overhead.py)
        self.overheads = {
            "disaggregated": TtftOverhead(OVERHEAD_CAP * config.prefill.max_ttft_ms / 1e3),
            "colocated": TtftOverhead(OVERHEAD_CAP * config.colocated.max_ttft_ms / 1e3),
        }

    async def run(self) -> None:
        """Background work for as long as the Conductor serves: kvmeta's index, the other replicas' load."""
        await asyncio.gather(self.kv.run(), self.shared.run())

    async def Generate(  # noqa: N802
        self, request: conductor_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[conductor_pb2.GenerateResponse]:
        """Schedule, run and stream one request."""
        if request.deployment not in conductor_pb2.Deployment.values():
            raise ValueError(f"unknown deployment {request.deployment}")
        await self.view.wait_for(lambda: self._can_serve(request.deployment), self.config.scheduler.worker_wait_s)
        job = await self._admit(request)
        deployment = self._deployment(request.deployment)
        job.path = "colocated" if deployment == "colocated" else "disaggregated"  # conditional: set by each plan
        span = trace.get_current_span()
        span.set_attributes(
            {"kvconductor.request_id": job.request_id, "kvconductor.client_request_id": job.label,
             "kvconductor.deployment": deployment,
             "kvconductor.prompt_tokens": len(job.prompt), "kvconductor.max_tokens": job.sampling.max_tokens}
        )  # fmt: skip
        attempts = {"disaggregated": self._disaggregated, "colocated": self._colocated,
                    "conditional": self._conditional}  # fmt: skip
        outcome = "failed"
        try:
            pieces = self._with_retries(job, attempts[deployment])
            async for response in self._relay(job, pieces, request.include_decision):
                yield response
            outcome = "completed"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except RpcError as e:
            outcome = "rejected" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
            raise
        finally:
            metrics.REQUESTS.labels(job.path, outcome).inc()
            span.set_attributes({"kvconductor.path": job.path, "kvconductor.outcome": outcome})

    async def ExplainDecision(  # noqa: N802
        self, request: conductor_pb2.ExplainDecisionRequest, context: Any
    ) -> conductor_pb2.Decision:
        """The recorded decision of a recent request."""
        decision = self.decisions.get(request.request_id)
        if decision is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"no decision recorded for request {request.request_id!r}")
        return decision

    def _instance_status(self, v: InstanceView, now: float) -> conductor_pb2.InstanceStatus:
        """One instance as GetStatus reports it: its record, this Conductor's bookings there and the others'."""
        overcommit = self.shared.overcommit.get(v.instance_id, Overcommit())
        return conductor_pb2.InstanceStatus(
            role=v.role,
            instance_id=v.instance_id,
            address=v.record.address,
            num_blocks=v.record.num_blocks,
            num_running=len(v.state.decoding.items.keys() | v.state.prefilling.items.keys()),
            t_queue_ms=v.state.t_queue(now) * 1e3,
            record_json=json.dumps(v.record.to_json(), sort_keys=True),
            scheduling=self.view.scheduling(v.instance_id, now),
            num_foreign=len(v.state.foreign_decoding.items.keys() | v.state.foreign_prefilling.items.keys()),
            overcommit_requests_max=overcommit.requests,
            overcommit_blocks_max=overcommit.blocks,
            indexed_blocks=self.kv.index.num_blocks(v.instance_id),
        )

    async def GetStatus(  # noqa: N802
        self, request: conductor_pb2.GetStatusRequest, context: Any
    ) -> conductor_pb2.GetStatusResponse:
        """The instances being scheduled on, the Conductor's load bookkeeping and prediction errors."""
        now = time.monotonic()
        window = request.window_s if request.window_s > 0 else DEFAULT_WINDOW_S
        instances = [
            self._instance_status(v, now)
            for v in sorted(self.view.instances.values(), key=lambda v: (v.role, v.instance_id))
        ]
        return conductor_pb2.GetStatusResponse(
            instances=instances,
            model=self.config.model.name,
            prediction_errors=self.errors.summary(window),
            latencies=self.errors.latencies(window),
            ttft_overhead_ms={path: o.value(now) * 1e3 for path, o in self.overheads.items()},
            links=[
                conductor_pb2.LinkStatus(
                    source=src,
                    destination=dst,
                    samples=n,
                    bandwidth_gbps=fit.bandwidth_bytes_per_s * 8 / 1e9 if fit else 0.0,
                    latency_ms=fit.latency_s * 1e3 if fit else 0.0,
                )
                for src, dst, n, fit in self.core.links.learned()
            ],
            store_json=json.dumps(self.view.store.to_json(), sort_keys=True) if self.view.store else "",
            rejections=dict(self.rejections),
            kv_index_source=self.kv.following,
        )

    # -- admission -------------------------------------------------------------------------------

    async def _admit(self, request: conductor_pb2.GenerateRequest) -> Job:
        if request.model and request.model != self.config.model.name:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        max_len = self.view.max_model_len()
        if max_len == 0:
            raise RpcError(UNAVAILABLE, "no healthy workers")
        check_limits(request, self.config.scheduler)
        prompt, packed = await self._prompt_ids(request, max_len)
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        _check_sampling(sampling)
        if sampling.max_tokens == 0:
            sampling.max_tokens = max_len - len(prompt)
        elif len(prompt) + sampling.max_tokens > max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the context length {max_len}"
            )
        if not sampling.HasField("seed"):
            # One seed for the whole request, so the prefill and decode workers sample as one engine would.
            sampling.seed = random.getrandbits(63)
        with metrics.STAGE.labels("hash").time():
            hashes = packed_block_hashes(packed, self.view.block_size())
        # The Conductor's own id, unique across replicas: the client's id is only a label (two clients may send
        # the same one), and a failed-over request gets fresh ids while the failed Conductor's are released.
        job = Job(uuid.uuid4().hex, prompt, sampling, list(request.stop), hashes, label=request.request_id)
        if request.resume_token_ids:  # a failed-over request: continue after what the client already has
            self._packed(conductor_pb2.TokenIds(ids=request.resume_token_ids))  # checked against the vocabulary
            resumed = list(request.resume_token_ids)
            if len(resumed) >= sampling.max_tokens:
                raise ValueError(f"{len(resumed)} resumed tokens leave nothing of max_tokens ({sampling.max_tokens})")
            job.generated = resumed
        return job

    async def _prompt_ids(self, request: conductor_pb2.GenerateRequest, max_len: int) -> tuple[Sequence[int], bytes]:
        """The prompt's token ids, and the same packed for hashing.

        Refused: an empty prompt, one of ``max_len`` tokens or more, an id outside the vocabulary. The length is
        checked first, before any per-token work on the loop (the vocabulary scan): a 1 MiB text prompt is a million
        tokens, tens of ms that every stream through this Conductor would wait for (bench/serve/neighbours.py). Ids
        sent as ids stay in the request's repeated field (the workers' requests copy it without a Python int per
        token).
        """
        which = request.WhichOneof("prompt")
        if which == "text":
            try:
                with metrics.STAGE.labels("tokenize").time():
                    text_ids: list[int] = await tokenize_off_loop(self.tokenizer, request.text, max_len - 1)
            except TooManyTokens as e:
                raise ValueError(too_long(e.count, max_len, e.at_least)) from None
            ids: Sequence[int] = text_ids
            message = conductor_pb2.TokenIds(ids=text_ids)
        elif which == "token_ids":
            message = request.token_ids
            ids = message.ids
            if len(ids) >= max_len:
                raise ValueError(too_long(len(ids), max_len))
        else:
            raise ValueError("the request needs a prompt: text or token_ids")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids, self._packed(message)

    def _packed(self, token_ids: conductor_pb2.TokenIds) -> bytes:
        """``token_ids`` as little-endian uint32; ValueError names the first id outside every worker's vocabulary."""
        vocab = min(v.record.vocab_size for v in self.view.instances.values())
        return packed_token_ids(token_ids.SerializeToString(), vocab)

    def _can_serve(self, deployment: int) -> bool:
        """Whether workers that ``deployment`` may use are registered now."""
        has_pd = bool(self.view.pool("prefill")) and bool(self.view.pool("decode"))
        has_colocated = bool(self.view.pool("colocated"))  # a conditional request prefills there when it must
        if deployment == conductor_pb2.DEPLOYMENT_DISAGGREGATED:
            return has_pd
        if deployment in (conductor_pb2.DEPLOYMENT_COLOCATED, conductor_pb2.DEPLOYMENT_CONDITIONAL):
            return has_colocated
        return has_pd or has_colocated

    def _deployment(self, deployment: int) -> str:
        """The request's serving path: "disaggregated", "colocated" or "conditional" (either, per request).

        Auto: disaggregated when prefill and decode workers exist; else conditional when prefill and colocated
        workers do (and the engine's colocated workers take KV: not vLLM's yet); else colocated.
        """
        has_pd = bool(self.view.pool("prefill")) and bool(self.view.pool("decode"))
        has_colocated = bool(self.view.pool("colocated"))
        takes_kv = self.config.engine.backend != "vllm"
        if deployment == conductor_pb2.DEPLOYMENT_DISAGGREGATED:
            if not has_pd:
                raise RpcError(UNAVAILABLE, "no prefill/decode workers are available")
            return "disaggregated"
        if deployment == conductor_pb2.DEPLOYMENT_CONDITIONAL and not takes_kv:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "conditional disaggregation needs colocated workers "
                "that take KV from prefill workers: the builtin and emulated engines' (not vLLM's yet)",
            )
        if deployment in (conductor_pb2.DEPLOYMENT_COLOCATED, conductor_pb2.DEPLOYMENT_CONDITIONAL):
            if not has_colocated:
                raise RpcError(UNAVAILABLE, "no colocated workers are available")
            return "colocated" if deployment == conductor_pb2.DEPLOYMENT_COLOCATED else "conditional"
        if has_pd:
            return "disaggregated"
        if not has_colocated:
            raise RpcError(UNAVAILABLE, "no healthy workers")
        return "conditional" if self.view.pool("prefill") and takes_kv else "colocated"

    def _prefix_lens(self, job: Job, pool: list[InstanceView], store: str = "") -> dict[str, int]:
        """Cached prefix length (tokens) per instance, and in the Store under ``store``, from the KV index replica."""
        block_size = self.view.block_size()
        ids = [v.instance_id for v in pool] + ([store] if store else [])
        return {i: n * block_size for i, n in self.kv.match(job.attempt_hashes(block_size), ids).items()}

    async def _plan(
        self, job: Job, prefills: list[InstanceView], decodes: list[InstanceView], conditional: bool = False
    ) -> Plan:
        """Run the policy; record the decision; raise RESOURCE_EXHAUSTED on a rejection.

        ``conditional``: ``decodes`` are colocated instances, which may prefill the request themselves.
        """
        while True:
            with tracer.start_as_current_span("conductor.schedule") as span:
                outcome = await self._decide(job, prefills, decodes, conditional)
                if span.is_recording() and job.decision is not None:  # the decision as JSON: for a recorded span
                    span.set_attributes(decision_attributes(job.decision.message()))
            if not (isinstance(outcome, Rejection) and outcome.retry_in > 0):
                break
            log.debug("request %s deferred %.0f ms: %s", job.name, outcome.retry_in * 1e3, outcome.reason)
            metrics.DEFERRALS.inc()
            start = time.monotonic()
            await asyncio.sleep(outcome.retry_in)
            job.deferred_s += time.monotonic() - start
        if isinstance(outcome, Rejection):
            log.info("request %s rejected: %s", job.name, outcome.reason)
            metrics.REJECTIONS.labels(outcome.kind).inc()
            self.rejections[outcome.kind] += 1
            raise rejection_error(outcome, self.config, colocated=conditional or prefills is decodes)
        log.info("request %s: %s", job.name, outcome.reason)
        if outcome.probe:
            metrics.PROBES.inc()
        if conditional:
            metrics.CONDITIONAL_PATHS.labels("local" if is_local(outcome) else "remote").inc()
        job.plan = outcome
        return outcome

    async def _decide(
        self, job: Job, prefills: list[InstanceView], decodes: list[InstanceView], conditional: bool
    ) -> Plan | Rejection:
        colocated = prefills is decodes  # one pool in both roles (conditional: ``decodes`` also prefill)
        store_id = self.view.store.instance_id if self.view.store is not None and not colocated else ""
        with metrics.STAGE.labels("match").time():
            prefix = self._prefix_lens(job, [*prefills, *decodes] if conditional else prefills, store_id)
        store = CopySource(store_id, prefix.pop(store_id)) if store_id in prefix else None
        now = time.monotonic()
        # A conditional request decodes on a colocated instance wherever it prefills: [colocated]'s SLOs.
        ttft_cfg: WorkerConfig = self.config.colocated if colocated or conditional else self.config.prefill
        tbt_cfg: WorkerConfig = self.config.colocated if colocated or conditional else self.config.decode
        slo = Slo(
            ttft_cfg.max_ttft_ms / 1e3,
            tbt_cfg.max_tbt_ms / 1e3,
            self.config.scheduler.reject_on_slo_violation,
            ttft_overhead=self.overheads["colocated" if conditional else job.path].value(now) + job.deferred_s,
        )
        with metrics.STAGE.labels("decide").time():
            shape = self._shape(job, decodes[0].record)
            hashes = job.attempt_hashes(shape.block_size)
            prefill_states, decode_states = [v.state for v in prefills], [v.state for v in decodes]
            outcome = (
                self.core.decide_conditional(now, shape, prefix, prefill_states, decode_states, slo, store, hashes)
                if conditional
                else self.core.decide(now, shape, prefix, prefill_states, decode_states, slo, colocated, store, hashes)
            )
            if job.deferred_s and isinstance(outcome, Plan):
                outcome = replace(outcome, reason=f"{outcome.reason}; planned after {job.deferred_s * 1e3:.0f} ms "
                                  "waiting for a request decoding there to leave")  # fmt: skip
            job.decision = DecisionRecord(job.request_id, self.core.policy.config.policy, outcome, job.label)
            self.decisions.record(job.decision)
        return outcome

    def _copy_source(self, instance_id: str) -> prefill_pb2.KVSource | None:
        """Where the planned copy reads from: a prefill worker's pool, or the Store (None: it left meanwhile)."""
        if not instance_id:
            return None
        if self.view.store is not None and instance_id == self.view.store.instance_id:
            return prefill_pb2.KVSource(instance_id=instance_id, tier=common_pb2.KV_TIER_STORE)
        source = self.view.instances.get(instance_id)
        return prefill_pb2.KVSource(instance_id=instance_id, address=source.record.address) if source else None

    def _shape(self, job: Job, record: WorkerRecord) -> RequestShape:
        block_size, max_tokens = record.block_size, job.attempt_sampling.max_tokens
        return RequestShape(
            num_prompt_tokens=len(job.tokens),
            num_blocks=request_blocks(len(job.tokens), max_tokens, block_size),
            block_size=block_size,
            bytes_per_block=record.kv_layout.bytes_per_block,
            output_tokens=self.core.expected_output_tokens(max_tokens, job.fixed_length),
        )

    def _assign(self, job: Job, plan: Plan, p: InstanceView, d: InstanceView) -> None:
        """Book the request's prefill work on p and its decode footprint on d."""
        with metrics.STAGE.labels("book").time():
            shape = self._shape(job, p.record)
            self.core.book(time.monotonic(), job.request_id, plan, shape, p.state, d.state,
                           job.attempt_hashes(shape.block_size))  # fmt: skip

    def _progress(self, job: Job, d: InstanceView, tokens_out: int, max_tokens: int) -> None:
        """``tokens_out`` of this attempt's ``max_tokens`` are out of d: its booking ends at their measured pace."""
        self.core.decode_progress(d.state, job.request_id, time.monotonic(), tokens_out, max_tokens, job.fixed_length)

    def _release(self, job: Job, *instances: InstanceView) -> None:
        self.core.release(job.request_id, time.monotonic(), *(v.state for v in instances))

    # -- the two serving paths -------------------------------------------------------------------

    async def _with_retries(
        self, job: Job, attempt: Callable[[Job], AsyncGenerator[Piece, None]]
    ) -> AsyncGenerator[Piece, None]:
        """Run attempts until one finishes; a failed worker's request resumes elsewhere with what it streamed.

        A resumed attempt prefills the prompt plus the tokens already streamed and continues from there,
        so the client's stream goes on without a gap or a repeat (greedy output is the same as without
        the failure). The failed instance is excluded for this request and avoided by others for a while.
        """
        for number in range(1, self.config.scheduler.max_attempts + 1):
            job.attempt = number
            try:
                async for piece in attempt(job):
                    job.generated += piece.token_ids
                    yield piece
                return
            except WorkerFailure as failure:
                if failure.stalled:  # no new work there until its engine moves; then it may serve the retry too
                    metrics.STALLS.labels(job.phase, failure.instance_id).inc()
                    self.view.suspect(failure.instance_id)
                else:
                    job.failed.add(failure.instance_id)
                    self.view.quarantine(failure.instance_id, self.config.cluster.lease_ttl_s + 1.0)
                trace.get_current_span().add_event(
                    "kvconductor.retry", {"attempt": number, "failed": str(failure), "streamed": len(job.generated)}
                )
                if number == self.config.scheduler.max_attempts:
                    raise RpcError(UNAVAILABLE, f"gave up after {number} attempts; last: {failure}") from failure
                log.warning("request %s: %s; resuming after %d streamed tokens", job.name, failure,
                            len(job.generated))  # fmt: skip
                metrics.RETRIES.labels(job.path).inc()

    async def _pool(self, role: str, job: Job) -> list[InstanceView]:
        """The role's instances this attempt may use; with none registered now, wait ``worker_wait_s`` for one.

        A retry goes elsewhere than the instances that failed this request; with nowhere else, to one of them that
        keeps its lease, once its quarantine ends (``ClusterView.pool_after_failures``), else the failure is the answer.
        """
        if not job.failed:
            await self.view.wait_for(lambda: bool(self.view.pool(role)), self.config.scheduler.worker_wait_s)
        pool = await self.view.pool_after_failures(role, job.failed, self.config.cluster.lease_ttl_s + 2.0)
        if not pool and job.failed:  # a retry with nowhere left to go: the failure, not a capacity rejection
            raise RpcError(UNAVAILABLE, f"no {role} instance left after {', '.join(sorted(job.failed))} failed")
        if not pool:  # every one of them is quarantined
            raise RpcError(UNAVAILABLE, f"no {role} instance is available now")
        return pool

    async def _disaggregated(self, job: Job) -> AsyncGenerator[Piece, None]:
        plan = await self._plan(job, await self._pool("prefill", job), await self._pool("decode", job))
        async for piece in self._remote(job, plan):
            yield piece

    async def _colocated(self, job: Job) -> AsyncGenerator[Piece, None]:
        pool = await self._pool("colocated", job)
        plan = await self._plan(job, pool, pool)
        async for piece in self._local(job, plan):
            yield piece

    async def _conditional(self, job: Job) -> AsyncGenerator[Piece, None]:
        """Prefill on a prefill instance and decode on a colocated one, or both on the colocated one: by plan."""
        mixed = await self._pool("colocated", job)
        plan = await self._plan(job, self.view.pool("prefill", exclude=job.failed), mixed, conditional=True)
        job.path = "colocated" if is_local(plan) else "disaggregated"
        pieces = self._local(job, plan) if is_local(plan) else self._remote(job, plan)
        async for piece in pieces:
            yield piece

    async def _remote(self, job: Job, plan: Plan) -> AsyncGenerator[Piece, None]:
        """Prefill on the plan's prefill instance into the decode instance's blocks; stream the decode."""
        tokens, sampling = job.tokens, job.attempt_sampling  # this attempt's, before it streams anything
        p = self.view.instances[plan.prefill.instance_id]
        d = self.view.instances[plan.decode_instance]
        self._assign(job, plan, p, d)
        prefilled = decoded = False
        try:
            job.phase = "prefill"
            first = await self._prefill_on(job, plan, p, d)
            prefilled = True  # d holds a reservation with the prompt's KV until its Decode call takes it
            self.core.decode_started(d.state, job.request_id, time.monotonic())
            job.phase = "decode"
            with blame(d.instance_id):
                # Called before token 0 goes downstream: d's decode must not wait for the relay to the client.
                call = d.decode_stub.Decode(
                    decode_pb2.DecodeRequest(
                        request_id=job.worker_request_id,
                        prompt_token_ids=tokens,
                        first_token_id=first.first_token_id,
                        sampling=sampling,
                    )
                )
                try:
                    yield Piece([first.first_token_id], cached_tokens=first.num_cached_tokens)
                    out = 1  # the prefill's first token
                    async for chunk in self._watch(call, d, "decode", plan.tbt, plan.tbt):
                        out += len(chunk.token_ids)
                        self._progress(job, d, out, sampling.max_tokens)
                        yield Piece(list(chunk.token_ids), chunk.finish_reason)
                    decoded = True
                finally:
                    call.cancel()
        finally:
            self._release(job, p, d)
            if prefilled and not decoded:  # the client left (or d failed) before Decode took the reservation
                self._release_reservation(job, d)

    def _stall_bound(self, predicted_s: float) -> float:
        """Seconds without progress after which the watchdog gives up on a worker."""
        s = self.config.scheduler
        return max(s.stall_timeout_s, s.stall_factor * predicted_s)

    async def _watch(
        self, call: AsyncIterator[Any], view: InstanceView, phase: str, first_s: float, next_s: float
    ) -> AsyncIterator[Any]:
        """A worker's stream under the progress watchdog (``_unless_stalled``) for each message.

        ``first_s`` and ``next_s`` are the predicted times to the first message and between later ones. One
        task reads the stream a few messages ahead (``_read_ahead``); a message already read is taken without
        waiting, so the watchdog costs a timer only when the Conductor has to wait (a task and an
        ``asyncio.wait`` per message cost more than relaying it).
        """
        ahead: asyncio.Queue[Any] = asyncio.Queue(READ_AHEAD)
        reader = asyncio.ensure_future(_read_ahead(call, ahead))
        try:
            bound = self._stall_bound(first_s)
            while True:
                item = (
                    ahead.get_nowait()
                    if not ahead.empty()
                    else await self._unless_stalled(ahead.get, view, phase, bound)
                )
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
                bound = self._stall_bound(next_s)
        finally:
            reader.cancel()

    async def _unless_stalled(self, wait: Callable[[], Awaitable[T]], view: InstanceView, phase: str,
                              bound: float) -> T:  # fmt: skip
        """What ``wait()`` returns, unless the worker stalls: the progress watchdog.

        After each ``bound`` seconds without it, the worker's engine must have turned within them (its
        heartbeat, from ``GetLoad``): a busy engine (a long prompt on a loaded machine, the requests queued ahead)
        keeps the request, for ``stall_factor`` bounds at most; a frozen or unreachable one loses it. ``wait``
        is called again after each bound, so it must be safe to cancel (a queue's ``get``, a shielded future).
        """
        rounds = math.ceil(self.config.scheduler.stall_factor)
        for left in range(rounds - 1, -1, -1):
            try:
                async with asyncio.timeout(bound):
                    return await wait()
            except TimeoutError:
                if not left or not await self._engine_turned(view, bound):  # no heartbeat to ask after the last
                    break
        raise self._stalled(view.instance_id, phase, bound)

    async def _engine_turned(self, view: InstanceView, within_s: float) -> bool:
        """Whether the worker's engine loop turned in the last ``within_s`` seconds."""
        try:
            load = await view.worker_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=min(within_s, 5.0))
        except grpc.aio.AioRpcError:
            return False
        return bool(load.engine_heartbeat_age_s < within_s)

    def _stalled(self, instance_id: str, phase: str, bound: float) -> WorkerFailure:
        log.warning("no %s progress on %s for %.1f s (the watchdog's bound): abandoning it there", phase,
                    instance_id, bound)  # fmt: skip
        return WorkerFailure.stall(instance_id, phase, bound)

    async def _prefill_on(self, job: Job, plan: Plan, p: InstanceView, d: InstanceView) -> prefill_pb2.PrefillResponse:
        """Reserve on d, prefill on p into d's blocks (copying KV first if planned); release d on failure."""
        tokens, sampling = job.tokens, job.attempt_sampling
        bound = self._stall_bound(plan.prefill.ttft)
        prefill_deadline = min(bound * (self.config.scheduler.stall_factor + 1), self.config.cluster.max_reserve_hold_s)
        try:
            with blame(d.instance_id):
                reserve = decode_pb2.ReserveRequest(
                    request_id=job.worker_request_id,
                    num_prompt_tokens=len(tokens),
                    sampling=sampling,
                    hold_s=prefill_deadline,  # the longest the prefill may take under the watchdog
                    booking=booking_message(
                        self.conductor_id, job.request_id, None, d.state, sampling.max_tokens, job.fixed_length
                    ),  # fmt: skip
                )
                if p.record.moves_kv_itself:  # vLLM: d's connector pulls the KV from p's when the decode runs
                    reserve.remote_prefill.engine_id = p.instance_id
                    reserve.remote_prefill.bootstrap_addr = p.record.kv_bootstrap
                reserved = await d.decode_stub.Reserve(reserve, timeout=self.config.scheduler.stall_timeout_s)
            request = prefill_pb2.PrefillRequest(
                request_id=job.worker_request_id,
                prompt_token_ids=tokens,
                sampling=sampling,
                destination=reserved.target,
                booking=booking_message(self.conductor_id, job.request_id, p.state, None),
            )
            source = self._copy_source(plan.prefill.copy_from)
            if source is not None:
                request.copy_source.CopyFrom(source)
                request.copy_num_blocks = plan.prefill.prefix_len // self.view.block_size()
            # A failed write into d's blocks is d's (or the link's) failure, not p's.
            pending = asyncio.ensure_future(p.prefill_stub.Prefill(request, timeout=prefill_deadline))
            try:
                response = await self._unless_stalled(lambda: asyncio.shield(pending), p, "prefill", bound)
            finally:
                pending.cancel()  # a no-op once done
        except grpc.aio.AioRpcError as e:
            self._release_reservation(job, d)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the watchdog's deadline
                raise self._stalled(p.instance_id, "prefill", bound) from e
            at_fault = d if (e.details() or "").startswith(KV_TRANSFER_FAILED) else p
            if e.code() in RETRYABLE:
                raise WorkerFailure(at_fault.instance_id, e) from e
            raise
        except BaseException:
            self._release_reservation(job, d)
            raise
        finally:
            self.core.prefill_done(p.state, job.request_id, time.monotonic())
        self._learn(job, p, d, response)
        return response

    def _release_reservation(self, job: Job, d: InstanceView) -> None:
        """Give back d's blocks, in the background: a dead or cut-off d must not delay the request's retry.

        Best effort: a dead d has lost them anyway, and a live one frees them after kv_transfer_timeout_s.
        """
        request = decode_pb2.ReleaseRequest(request_id=job.worker_request_id)  # this attempt's, not the next's

        async def release() -> None:
            with contextlib.suppress(Exception):  # a closed channel, a cut link, a dead worker
                await d.decode_stub.Release(request, timeout=5.0)

        spawn(release(), f"releasing {job.worker_request_id}'s blocks on {d.instance_id}")

    def _learn(self, job: Job, p: InstanceView, d: InstanceView, r: prefill_pb2.PrefillResponse) -> None:
        """Feed measured transfers to the link models, the prediction errors and the decision; log them."""
        plan = job.plan
        if plan is None:
            return
        if job.decision is not None:
            job.decision.observed.MergeFrom(
                conductor_pb2.Outcome(
                    prefill_ms=r.prefill_seconds * 1e3,
                    kv_send_ms=r.transfer_seconds * 1e3,
                    kv_send_exposed_ms=r.transfer_exposed_seconds * 1e3,
                    kv_copy_ms=r.copy_seconds * 1e3,
                    copied_tokens=r.copied_tokens,
                    cached_tokens=r.num_cached_tokens,
                    copy_note=r.copy_note,
                )
            )
        job.worker_ttft = r.prefill_seconds + r.transfer_exposed_seconds
        if r.kv_bytes_sent:  # 0: the engine's own connector moved the KV (vLLM): its pushes come below
            self.core.links.observe(p.instance_id, d.instance_id, r.kv_bytes_sent, r.transfer_seconds)
            self.errors.record("kv_send", plan.prefill.t_send, r.transfer_exposed_seconds)
        for push in r.kv_pushes:  # timed by the connector, to whichever decode worker: p's send link, any destination
            self.core.links.observe(p.instance_id, "", push.bytes, push.seconds)
        if r.copy_bytes and r.copy_seconds:  # untimed: vLLM's Store connector's reads were not reported in time
            self.core.links.observe(plan.prefill.copy_from, p.instance_id, r.copy_bytes, r.copy_seconds)
            self.errors.record("kv_copy", plan.prefill.t_transfer, r.copy_seconds)
        copy = f", copied {r.copied_tokens} tokens in {r.copy_seconds * 1e3:.1f} ms" if r.copied_tokens else ""
        note = f" ({r.copy_note})" if r.copy_note else ""
        log.info(
            "prefill %s: cached %d, computed %d in %.1f ms%s%s; %d KV bytes to %s in %.1f ms (%.1f ms after token 0)",
            p.instance_id, r.num_cached_tokens, r.num_computed_tokens, r.prefill_seconds * 1e3, copy, note,
            r.kv_bytes_sent, d.instance_id, r.transfer_seconds * 1e3, r.transfer_exposed_seconds * 1e3,
        )  # fmt: skip

    async def _local(self, job: Job, plan: Plan) -> AsyncGenerator[Piece, None]:
        """Prefill and decode on the plan's colocated instance."""
        c = self.view.instances[plan.prefill.instance_id]
        self._assign(job, plan, c, c)
        sampling = job.attempt_sampling
        request = colocated_pb2.ColocatedRequest(
            request_id=job.worker_request_id,
            prompt_token_ids=job.tokens,
            sampling=sampling,
            booking=booking_message(
                self.conductor_id, job.request_id, c.state, c.state, sampling.max_tokens, job.fixed_length
            ),  # fmt: skip
        )
        job.phase = "colocated"
        with blame(c.instance_id):
            call = c.colocated_stub.Generate(request)
            try:
                out = 0
                async for chunk in self._watch(call, c, "colocated", plan.prefill.ttft, plan.tbt):
                    out += len(chunk.token_ids)
                    self.core.prefill_done(c.state, job.request_id, time.monotonic())
                    self._progress(job, c, out, sampling.max_tokens)
                    yield Piece(list(chunk.token_ids), chunk.finish_reason, chunk.num_cached_tokens)
            finally:
                call.cancel()
                self._release(job, c)

    # -- relaying ----------------------------------------------------------------------------------

    async def _relay(
        self, job: Job, pieces: AsyncGenerator[Piece, None], include_decision: bool
    ) -> AsyncIterator[conductor_pb2.GenerateResponse]:
        detok = Detokenizer(self.tokenizer, job.stop)
        detok.add(job.generated)  # a resumed request's: its text reached the client through the Conductor that failed
        completion, cached = len(job.generated), 0
        times: list[float] = []
        try:
            async for piece in pieces:
                times.append(time.monotonic())
                completion += len(piece.token_ids)
                cached = max(cached, piece.cached_tokens)
                text = detok.add(piece.token_ids)
                finish = common_pb2.FINISH_REASON_STOP if detok.stopped else piece.finish_reason
                final = finish != common_pb2.FINISH_REASON_UNSPECIFIED
                response = conductor_pb2.GenerateResponse(
                    request_id=job.client_id, token_ids=piece.token_ids, text=text + (detok.flush() if final else "")
                )
                if len(times) == 1:
                    response.conductor_request_id = job.request_id
                    if include_decision and job.decision is not None:
                        response.decision.CopyFrom(job.decision.message())
                if final:
                    response.finish_reason = finish
                    response.usage.CopyFrom(
                        conductor_pb2.Usage(
                            prompt_tokens=len(job.prompt), completion_tokens=completion, cached_tokens=cached
                        )
                    )
                    # Before the client sees the end: an ExplainDecision right after it finds the outcome.
                    self._observe(job, times, completion, cached)
                yield response
                if final:
                    return
        finally:
            await pieces.aclose()
        raise RpcError(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish reason")

    def _observe(self, job: Job, times: list[float], completion_tokens: int, cached_tokens: int) -> None:
        """Record the request's real TTFT and TBT against the plan's predictions."""
        if job.plan is None:
            return
        ttft = times[0] - job.arrived
        tbt = (times[-1] - times[1]) / (len(times) - 2) if len(times) > 2 else 0.0
        self.errors.record("ttft", job.plan.ttft, ttft)
        overhead = _overhead_sample(job, ttft)
        if overhead is not None:
            self.overheads[job.path].observe(time.monotonic(), overhead)
        self.errors.record("tbt", job.plan.tbt, tbt)
        metrics.TTFT.labels(job.path).observe(ttft)
        metrics.E2E.labels(job.path).observe(times[-1] - job.arrived)
        if tbt:
            metrics.TBT.labels(job.path).observe(tbt)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]  # gaps[0]: token 0 to token 1
        for gap in gaps[1:]:
            metrics.ITL.labels(job.path).observe(gap)
        metrics.PROMPT_TOKENS.inc(len(job.prompt))
        metrics.CACHED_TOKENS.inc(cached_tokens)
        trace.get_current_span().set_attributes(
            {"kvconductor.ttft_ms": ttft * 1e3, "kvconductor.tbt_ms": tbt * 1e3,
             "kvconductor.tbt_slo_ms": request_tbt(gaps) * 1e3, "kvconductor.tbt_max_ms": max(gaps, default=0.0) * 1e3,
             "kvconductor.completion_tokens": completion_tokens, "kvconductor.cached_tokens": cached_tokens}
        )  # fmt: skip
        if job.decision is not None:
            job.decision.observed.ttft_ms, job.decision.observed.tbt_ms = ttft * 1e3, tbt * 1e3
        self.core.observe_completion(completion_tokens)


class _Failed(NamedTuple):
    """The error that ended a worker's stream, passed from its reader to the request's task."""

    error: Exception


_END = object()  # the worker's stream ended


async def _read_ahead(call: AsyncIterator[Any], ahead: asyncio.Queue[Any]) -> None:
    """Read a worker's stream into ``ahead`` (bounded: the worker's flow control holds the rest), then _END."""
    try:
        async for message in call:
            await ahead.put(message)
        await ahead.put(_END)
    except Exception as e:  # noqa: BLE001 - handed to the request's task, which raises it
        await ahead.put(_Failed(e))


def _check_sampling(sampling: common_pb2.SamplingParams) -> None:
    """Refuse sampling values no worker can honour, before any is scheduled."""
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {sampling.temperature}")
    if not (sampling.top_p == 0 or 0 < sampling.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (0 = off), got {sampling.top_p}")


def _overhead_sample(job: Job, ttft: float) -> float | None:
    """The part of a request's TTFT that no instance model sees (rules in scheduler/ttft_overhead.py)."""
    if job.plan is None or job.failed or job.deferred_s:  # resumed: token 0 came from another attempt
        return None
    if job.plan.prefill.t_queue > 0:  # only requests that found the instance idle: no queueing enters it
        return None
    if job.worker_ttft is not None:  # what the prefill worker spent
        return ttft - job.worker_ttft
    return ttft - job.plan.prefill.ttft  # colocated: no report, so the instance's estimate


def services(servicer: ConductorServicer) -> list[Service]:
    """What the Conductor serves."""
    return [Service("kvconductor.v1.Conductor", servicer, conductor_pb2_grpc.add_ConductorServicer_to_server)]
