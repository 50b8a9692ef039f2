"""The decode worker: reserves KV blocks, lets a prefill worker write the prompt's KV into them, decodes.

Per request::

    Reserve: blocks for prompt + max_tokens, so decoding never runs out of KV memory; the addresses of
             the prompt's blocks go back to the Conductor, which hands them to the prefill worker
    Decode:  the prompt's KV is in place; the request joins the continuous batch with token 0 from
             prefill and streams every later token
    Release: a reservation that will not be decoded

A reservation whose Decode call has not come within its ``hold_s`` (the longest the Conductor lets the
prefill take, its queue included; at most ``[cluster] max_reserve_hold_s``) plus ``kv_transfer_timeout_s``
is released, so a prefill that died mid-way with its Conductor cannot pin decode memory (a live Conductor
releases it at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from kvconductor.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.rpc import RpcError, Service
from services.common.tasks import complete
from services.worker.engines.port import RemotePrefill
from services.worker.worker import Worker, sampling_from_proto, token_chunk

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """``Decode.Reserve``, ``Decode.Decode``, ``Decode.Release``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.reservations: dict[str, float] = {}  # request id -> deadline for its Decode call
        self.released: dict[str, float] = {}  # released before their Reserve arrived -> when to forget them
        worker.num_reserved = lambda: len(self.reservations)

    async def Reserve(self, request: decode_pb2.ReserveRequest, context: Any) -> decode_pb2.ReserveResponse:  # noqa: N802
        """Allocate blocks for the whole request and return the prompt blocks' addresses.

        The reservation is on the books before the engine allocates, and the allocation finishes even if
        the caller goes away (a cancelled Reserve): every allocated block is either released, decoded or
        expired, never orphaned.
        """
        w, rid = self.worker, request.request_id
        params = sampling_from_proto(request.sampling)
        if rid in self.reservations:
            raise ValueError(f"request {rid!r} already holds a reservation")
        if not 0 <= request.hold_s <= w.config.cluster.max_reserve_hold_s:
            raise ValueError(f"hold_s {request.hold_s:g} is outside 0..[cluster] max_reserve_hold_s "
                             f"({w.config.cluster.max_reserve_hold_s:g})")  # fmt: skip
        if self.released.pop(rid, None) is not None:
            raise RpcError(grpc.StatusCode.CANCELLED, f"request {rid!r} was released before its reservation came")
        # held through the prefill the Conductor plans (its queue included), then kv_transfer_timeout_s
        self.reservations[rid] = time.monotonic() + request.hold_s + w.config.cluster.kv_transfer_timeout_s
        w.ledger.add(rid, request.booking)
        remote = request.remote_prefill
        remote_prefill = RemotePrefill(remote.engine_id, remote.bootstrap_addr) if remote.engine_id else None

        async def reserve() -> tuple[list[int] | None, int]:
            blocks, free = await w.engine.reserve(rid, request.num_prompt_tokens, params, remote_prefill)
            if blocks is not None and rid not in self.reservations:  # released while we allocated
                await w.engine.abort(rid)
            return blocks, free

        try:
            blocks, free = await complete(reserve())
        except ValueError:
            self._forget(rid)
            raise
        if blocks is None:
            self._forget(rid)
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"not enough free KV blocks ({free} free)")
        if w.engine.moves_kv_itself:  # the engine's connector pulls the KV when the decode runs
            return decode_pb2.ReserveResponse(target=common_pb2.KVBlockTarget(), num_free_blocks=free)
        layout = w.engine.layout
        prompt_blocks = blocks[: layout.num_blocks_for(request.num_prompt_tokens)]
        target = common_pb2.KVBlockTarget(
            transfer_endpoint=w.transfer.endpoint,
            block_addresses=[layout.block_address(b) for b in prompt_blocks],
            bytes_per_block=layout.bytes_per_block,
        )
        return decode_pb2.ReserveResponse(target=target, num_free_blocks=free)

    async def Decode(self, request: decode_pb2.DecodeRequest, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:  # noqa: N802
        """Join the batch with token 0 and stream the following tokens."""
        w, rid = self.worker, request.request_id
        if self.reservations.pop(rid, None) is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation for request {rid!r} (expired?)")
        w.ledger.decode_started(rid)
        prompt, params = list(request.prompt_token_ids), sampling_from_proto(request.sampling)
        if not w.engine.moves_kv_itself:
            num_blocks = w.engine.layout.num_blocks_for(len(prompt))
            w.transfer.count_received(num_blocks, num_blocks * w.engine.layout.bytes_per_block)
        span = trace.get_current_span()
        gaps: list[float] = []
        last: float | None = None
        tokens = 0
        try:
            decoding = w.engine.decode(rid, prompt, request.first_token_id, params)
            async with contextlib.aclosing(decoding) as outputs:
                async for out in outputs:
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    tokens += len(out.new_token_ids)
                    w.ledger.produced(rid, len(out.new_token_ids))
                    if out.new_token_ids or out.finished:
                        yield token_chunk(list(out.new_token_ids), out.finish_reason)
        finally:
            w.ledger.remove(rid)
            span.set_attributes({"kvconductor.decode.tokens": tokens, **_tbt_attributes(gaps)})

    async def Release(self, request: decode_pb2.ReleaseRequest, context: Any) -> decode_pb2.ReleaseResponse:  # noqa: N802
        """Free a reservation that will not be decoded."""
        rid = request.request_id
        if self.reservations.pop(rid, None) is None:  # not come yet (a cancelled Reserve may still arrive)
            self.released[rid] = time.monotonic() + self.worker.config.cluster.kv_transfer_timeout_s
            return decode_pb2.ReleaseResponse(released=False)
        self.worker.ledger.remove(rid)
        await self.worker.engine.abort(rid)  # reserved, never in a batch
        return decode_pb2.ReleaseResponse(released=True)

    def _forget(self, rid: str) -> None:
        self.reservations.pop(rid, None)
        self.worker.ledger.remove(rid)

    async def expire_reservations(self) -> None:
        """Release reservations whose KV never came (runs for the worker's lifetime)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid in [rid for rid, until in self.released.items() if until < now]:
                del self.released[rid]
            for rid in [rid for rid, deadline in self.reservations.items() if deadline < now]:
                log.warning("reservation %s expired before its KV arrived; releasing its blocks", rid)
                self._forget(rid)
                await self.worker.engine.abort(rid)


def _tbt_attributes(gaps: list[float]) -> dict[str, float | int]:
    """Gaps between the decode's outputs (a busy engine may hand over several tokens in one output)."""
    if not gaps:
        return {"kvconductor.decode.steps": 0}
    ordered = sorted(gaps)
    return {
        "kvconductor.decode.steps": len(gaps),
        "kvconductor.decode.tbt_mean_ms": sum(gaps) / len(gaps) * 1e3,
        "kvconductor.decode.tbt_p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "kvconductor.decode.tbt_max_ms": ordered[-1] * 1e3,
    }


def services(worker: Worker) -> tuple[list[Service], DecodeServicer]:
    """Everything a decode worker serves (and the servicer, whose expiry task the caller runs)."""
    servicer = DecodeServicer(worker)
    decode = Service("kvconductor.v1.Decode", servicer, decode_pb2_grpc.add_DecodeServicer_to_server)
    return [decode, *worker.services()], servicer
