"""The Conductor: the global scheduler and the public ``Generate`` API.

Per request: tokenize -> chained block hashes -> kvmeta prefix match per instance -> Algorithm 1
(``scheduler.policy``) -> reserve on the decode instance -> prefill (its KV goes straight into the
reserved blocks) -> relay token 0 and the decode stream, detokenized, with stop strings, usage and
the decision. On the colocated path one instance does both. Cancelling the call cancels the
downstream calls, which free their KV.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from tokenizers import Tokenizer

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import (
    colocated_pb2,
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    decode_pb2,
    kvmeta_pb2,
    kvmeta_pb2_grpc,
    prefill_pb2,
)
from scheduler.cost_model import TransferModel
from scheduler.policy import Plan, Rejection, RequestShape, Slo, schedule
from services.cluster_view import Assignment, ClusterView, InstanceView, request_blocks
from services.config import Config
from services.detokenizer import Detokenizer
from services.rpc import RpcError, Service

log = logging.getLogger(__name__)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@dataclass
class Job:
    """A validated request."""

    request_id: str
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    stop: list[str]
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class Piece:
    """Tokens from a worker, with what the first one knows about the request."""

    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    cached_tokens: int = 0
    decision: conductor_pb2.Decision | None = None


class ConductorServicer(conductor_pb2_grpc.ConductorServicer):
    """``Conductor.Generate`` and ``Conductor.GetStatus``."""

    def __init__(self, config: Config, view: ClusterView, tokenizer: Tokenizer) -> None:
        self.config = config
        self.view = view
        self.tokenizer = tokenizer
        self.send_model = TransferModel.from_gbps(config.cluster.transfer_bandwidth_gbps)

    async def Generate(  # noqa: N802
        self, request: conductor_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[conductor_pb2.GenerateResponse]:
        """Schedule, run and stream one request."""
        job = self._admit(request)
        disaggregated = self._use_disaggregated(request.deployment)
        pieces = self._disaggregated(job) if disaggregated else self._colocated(job)
        async for response in self._relay(job, pieces):
            yield response

    async def GetStatus(  # noqa: N802
        self, request: conductor_pb2.GetStatusRequest, context: Any
    ) -> conductor_pb2.GetStatusResponse:
        """The instances being scheduled on and the Conductor's load bookkeeping."""
        now = time.monotonic()
        instances = [
            conductor_pb2.InstanceStatus(
                role=v.role,
                instance_id=v.instance_id,
                address=v.record["address"],
                num_blocks=int(v.record["num_blocks"]),
                num_running=len(v.decoding) + len(v.prefilling),
                t_queue_ms=v.t_queue(now) * 1e3,
                record_json=json.dumps(v.record, sort_keys=True),
            )
            for v in sorted(self.view.instances.values(), key=lambda v: (v.role, v.instance_id))
        ]
        return conductor_pb2.GetStatusResponse(instances=instances, model=self.config.model.name)

    # -- admission -------------------------------------------------------------------------------

    def _admit(self, request: conductor_pb2.GenerateRequest) -> Job:
        if request.model and request.model != self.config.model.name:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        max_len = self.view.max_model_len()
        if max_len == 0:
            raise RpcError(UNAVAILABLE, "no healthy workers")
        prompt = self._prompt_ids(request)
        if len(prompt) >= max_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context length is {max_len}")
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
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
        rid = request.request_id or uuid.uuid4().hex
        hashes = prefix_block_hashes(prompt, self.view.block_size())
        return Job(rid, prompt, sampling, list(request.stop), hashes)

    def _prompt_ids(self, request: conductor_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt: list[int] = self.tokenizer.encode(request.text, add_special_tokens=False).ids
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise ValueError("the request needs a prompt: text or token_ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = min(int(v.record["vocab_size"]) for v in self.view.instances.values())
        if max(prompt) >= vocab:
            raise ValueError(f"token id {max(prompt)} is outside the vocabulary (size {vocab})")
        return prompt

    def _use_disaggregated(self, deployment: int) -> bool:
        has_pd = bool(self.view.pool("prefill")) and bool(self.view.pool("decode"))
        has_colocated = bool(self.view.pool("colocated"))
        if deployment == conductor_pb2.DEPLOYMENT_DISAGGREGATED:
            if not has_pd:
                raise RpcError(UNAVAILABLE, "no prefill/decode workers are available")
            return True
        if deployment == conductor_pb2.DEPLOYMENT_COLOCATED:
            if not has_colocated:
                raise RpcError(UNAVAILABLE, "no colocated workers are available")
            return False
        if not has_pd and not has_colocated:
            raise RpcError(UNAVAILABLE, "no healthy workers")
        return has_pd

    async def _prefix_lens(self, job: Job, pool: list[InstanceView]) -> dict[str, int]:
        """Cached prefix length (tokens) per instance; empty when kvmeta cannot answer (cache-unaware)."""
        if not job.block_hashes or not self.view.kvmeta_address:
            return {}
        request = kvmeta_pb2.MatchPrefixRequest(
            block_hashes=job.block_hashes, instance_ids=[v.instance_id for v in pool]
        )
        try:
            async with grpc.aio.insecure_channel(self.view.kvmeta_address) as channel:
                response = await kvmeta_pb2_grpc.KvMetaStub(channel).MatchPrefix(request, timeout=1.0)
        except grpc.aio.AioRpcError as e:
            log.warning("kvmeta unavailable (%s): scheduling without prefix matches", e.code().name)
            return {}
        block_size = self.view.block_size()
        return {m.instance_id: m.prefix_blocks * block_size for m in response.matches}

    async def _plan(self, job: Job, prefills: list[InstanceView], decodes: list[InstanceView]) -> Plan:
        prefix = await self._prefix_lens(job, prefills)
        now = time.monotonic()
        record = (prefills or decodes)[0].record
        shape = RequestShape(
            num_prompt_tokens=len(job.prompt),
            num_blocks=request_blocks(len(job.prompt), job.sampling.max_tokens, int(record["block_size"])),
            kv_bytes=-(-len(job.prompt) // int(record["block_size"])) * int(record["kv_layout"]["bytes_per_block"]),
        )
        pool_cfg = self.config.prefill if decodes is not prefills else self.config.colocated
        decode_cfg = self.config.decode if decodes is not prefills else self.config.colocated
        slo = Slo(
            pool_cfg.max_ttft_ms / 1e3,
            decode_cfg.max_tbt_ms / 1e3,
            self.config.scheduler.reject_on_slo_violation,
        )
        result = schedule(
            [v.prefill_candidate(prefix.get(v.instance_id, 0), now) for v in prefills],
            [v.decode_candidate() for v in decodes],
            shape,
            slo,
            self.send_model if decodes is not prefills else None,
        )
        if isinstance(result, Rejection):
            log.info("request %s rejected: %s", job.request_id, result.reason)
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rejected: {result.reason}")
        return result

    # -- the two serving paths -------------------------------------------------------------------

    async def _disaggregated(self, job: Job) -> AsyncGenerator[Piece, None]:
        prefills, decodes = self.view.pool("prefill"), self.view.pool("decode")
        plan = await self._plan(job, prefills, decodes)
        p = self.view.instances[plan.prefill.instance_id]
        d = self.view.instances[plan.decode_instance]
        decision = self._decision(plan, p, d)
        blocks = request_blocks(len(job.prompt), job.sampling.max_tokens, self.view.block_size())
        p.prefilling[job.request_id] = _assignment(plan.prefill.t_prefill, len(job.prompt), blocks)
        d.decoding[job.request_id] = _assignment(0.0, len(job.prompt), blocks)
        try:
            first = await self._prefill_on(job, p, d)
            yield Piece([first.first_token_id], cached_tokens=first.num_cached_tokens, decision=decision)
            call = d.decode_stub.Decode(
                decode_pb2.DecodeRequest(
                    request_id=job.request_id,
                    prompt_token_ids=job.prompt,
                    first_token_id=first.first_token_id,
                    sampling=job.sampling,
                )
            )
            try:
                async for chunk in call:
                    yield Piece(list(chunk.token_ids), chunk.finish_reason)
            finally:
                call.cancel()
        finally:
            p.prefilling.pop(job.request_id, None)
            d.decoding.pop(job.request_id, None)

    async def _prefill_on(self, job: Job, p: InstanceView, d: InstanceView) -> prefill_pb2.PrefillResponse:
        """Reserve on d, prefill on p into d's blocks; give the reservation back if prefill fails."""
        reserved = await d.decode_stub.Reserve(
            decode_pb2.ReserveRequest(
                request_id=job.request_id, num_prompt_tokens=len(job.prompt), sampling=job.sampling
            )
        )
        try:
            response: prefill_pb2.PrefillResponse = await p.prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=job.request_id,
                    prompt_token_ids=job.prompt,
                    sampling=job.sampling,
                    destination=reserved.target,
                )
            )
        except BaseException:
            await d.decode_stub.Release(decode_pb2.ReleaseRequest(request_id=job.request_id))
            raise
        finally:
            p.prefilling.pop(job.request_id, None)
        log.info(
            "request %s: prefill %s (cached %d, computed %d, %.1f ms) -> %d KV bytes in %.1f ms -> decode %s",
            job.request_id, p.instance_id, response.num_cached_tokens, response.num_computed_tokens,
            response.prefill_seconds * 1e3, response.kv_bytes_sent, response.transfer_seconds * 1e3, d.instance_id,
        )  # fmt: skip
        return response

    async def _colocated(self, job: Job) -> AsyncGenerator[Piece, None]:
        pool = self.view.pool("colocated")
        plan = await self._plan(job, pool, pool)
        c = self.view.instances[plan.prefill.instance_id]
        decision = self._decision(plan, c, c)
        blocks = request_blocks(len(job.prompt), job.sampling.max_tokens, self.view.block_size())
        c.prefilling[job.request_id] = _assignment(plan.prefill.t_prefill, len(job.prompt), blocks)
        c.decoding[job.request_id] = _assignment(0.0, len(job.prompt), blocks)
        call = c.colocated_stub.Generate(
            colocated_pb2.ColocatedRequest(
                request_id=job.request_id, prompt_token_ids=job.prompt, sampling=job.sampling
            )
        )
        try:
            first = True
            async for chunk in call:
                c.prefilling.pop(job.request_id, None)
                yield Piece(
                    list(chunk.token_ids),
                    chunk.finish_reason,
                    chunk.num_cached_tokens,
                    decision if first else None,
                )
                first = False
        finally:
            call.cancel()
            c.prefilling.pop(job.request_id, None)
            c.decoding.pop(job.request_id, None)

    def _decision(self, plan: Plan, p: InstanceView, d: InstanceView) -> conductor_pb2.Decision:
        e = plan.prefill
        others = ", ".join(f"{c.instance_id}={c.ttft * 1e3:.0f}ms" for c in plan.candidates)
        reason = (
            f"least predicted TTFT among prefill candidates ({others}); "
            f"decode {d.instance_id} has the lowest predicted TBT ({plan.tbt * 1e3:.1f} ms)"
        )
        log.info("request routed: prefill %s, decode %s: %s", p.instance_id, d.instance_id, reason)
        return conductor_pb2.Decision(
            prefill_instance=p.instance_id,
            decode_instance=d.instance_id,
            t_queue_ms=e.t_queue * 1e3,
            t_prefill_ms=e.t_prefill * 1e3,
            t_transfer_ms=e.t_send * 1e3,
            predicted_ttft_ms=e.ttft * 1e3,
            predicted_tbt_ms=plan.tbt * 1e3,
            prefix_len=e.prefix_len,
            best_len=plan.best_len,
            best_instance=plan.best_instance,
            kv_copy=False,
            reason=reason,
        )

    # -- relaying ----------------------------------------------------------------------------------

    async def _relay(
        self, job: Job, pieces: AsyncGenerator[Piece, None]
    ) -> AsyncIterator[conductor_pb2.GenerateResponse]:
        detok = Detokenizer(self.tokenizer, job.stop)
        completion, cached = 0, 0
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        try:
            async for piece in pieces:
                completion += len(piece.token_ids)
                cached = max(cached, piece.cached_tokens)
                text = detok.add(piece.token_ids)
                finish = common_pb2.FINISH_REASON_STOP if detok.stopped else piece.finish_reason
                final = finish != common_pb2.FINISH_REASON_UNSPECIFIED
                if final:
                    text += detok.flush()
                yield conductor_pb2.GenerateResponse(
                    request_id=job.request_id,
                    token_ids=piece.token_ids,
                    text=text,
                    finish_reason=finish,
                    decision=piece.decision,
                    usage=conductor_pb2.Usage(
                        prompt_tokens=len(job.prompt), completion_tokens=completion, cached_tokens=cached
                    )
                    if final
                    else None,
                )
                if final:
                    return
        finally:
            await pieces.aclose()
        raise RpcError(grpc.StatusCode.INTERNAL, "the worker stream ended without a finish reason")


def _assignment(predicted_prefill_s: float, context: int, blocks: int) -> Assignment:
    return Assignment(predicted_prefill_s, time.monotonic(), context, blocks)


def services(servicer: ConductorServicer) -> list[Service]:
    """What the Conductor serves."""
    return [Service("kvconductor.v1.Conductor", servicer, conductor_pb2_grpc.add_ConductorServicer_to_server)]
