"""The prefill worker: runs prompts with prefix reuse and writes their KV straight into a decode worker.

Per request::

    [KV copy planned: pull the missing prefix blocks from the best holder or the Mooncake Store, see
     services/worker/kv/copy.py]
    -> add_request(prefill_only) -> engine computes the uncached blocks, samples token 0
    -> transfer engine writes every prompt block (the last, partial one included) into the decode
       worker's reserved blocks, each chunk's blocks while the next chunk computes (services/worker/kv/stream.py)
    -> release the blocks (they stay in the prefix cache) -> announce newly stored / evicted blocks to
       kvmeta -> reply with token 0

The reply comes after the announcement, so a request that follows this one can already be routed to
the prefix it left behind. With ``[store] enabled`` the prompt's full blocks are then written through
to the Mooncake Store, off the request's path (services/worker/kv/store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from engine.block_hash import prefix_block_hashes
from engine.sampling import SamplingParams
from kvconductor.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.common import metrics
from services.common.rpc import Service
from services.common.tasks import complete, spawn
from services.common.telemetry import tracer
from services.worker.engines.port import ImportedBlocks
from services.worker.kv.copy import (
    ConnectorCopy,
    Exports,
    PrefixCopy,
    pull_by_connector,
    pull_from_store,
    pull_prefix,
    settle_store_load,
    store_load_by_connector,
)
from services.worker.kv.stream import KVStreamer
from services.worker.worker import Worker, sampling_from_proto

log = logging.getLogger(__name__)

# Of the KV pool, the most that write-throughs in flight keep pinned. A put caught by a master that hangs
# holds its pins until Mooncake gives up (2 x 30 s); this much of the pool is all it can take from the
# prompts that must be computed meanwhile. A longer prompt is put in pieces of at most this many blocks.
STORE_PIN_SHARE = 0.25


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """``Prefill.Prefill``, ``ExportBlocks`` and ``ReleaseBlocks``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.exports = Exports(worker)
        self.store_pins = 0  # blocks write-throughs in flight hold (or are about to)

    async def _write_through(self, prompt: list[int]) -> None:
        """Put the prompt's full blocks into the Mooncake Store, off the request's path, and index them there.

        The blocks are pinned while the Store reads them (the request released them into the prefix cache,
        where a later step could evict them), a piece at a time within the pins left to write-throughs
        (``STORE_PIN_SHARE`` of the pool). It stops at a block evicted before its pin, at a failed put, or
        when no pins are left (the next prompt sharing the blocks puts the rest).
        """
        w, store = self.worker, self.worker.store
        if store is None:
            return
        layout = w.engine.layout
        bs, budget = layout.block_size, int(layout.num_blocks * STORE_PIN_SHARE)
        full = len(prompt) // bs
        hashes = prefix_block_hashes(prompt[: full * bs], bs)
        done = 0
        while done < full and store.available:
            take = min(full - done, budget - self.store_pins)
            if take <= 0:
                log.debug("write-through stopped: %d blocks are pinned for the Store already", self.store_pins)
                return
            end = done + take
            self.store_pins += take
            try:
                blocks = await complete(w.engine.pin_cached_blocks(hashes[done:end], prompt[done * bs : end * bs]))
                try:
                    put = await complete(store.put(hashes[done : done + len(blocks)], blocks))
                finally:
                    await w.engine.unpin_blocks(blocks)
            finally:
                self.store_pins -= take
            if put.blocks:
                metrics.observe_transfer("store_put", put.bytes, put.seconds)
            await w.events.publish_store(store.store_id, put.stored, [])
            if put.note:
                log.info("write-through to the Store: %s", put.note)
                return
            if len(blocks) < take:
                return
            done = end

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:  # noqa: N802
        """Compute the prompt (after copying its prefix, if planned), send its KV, return the first token."""
        with self.worker.ledger.holding(request.request_id, request.booking):
            return await self._prefill(request)

    async def _prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        w, rid = self.worker, request.request_id
        prompt, params = list(request.prompt_token_ids), sampling_from_proto(request.sampling)
        if w.engine.moves_kv_itself:
            return await self._prefill_by_connector(request, prompt, params)
        destination = request.destination
        self._check_destination(destination, len(prompt))
        start = time.perf_counter()
        layout = w.engine.layout
        streamer = KVStreamer(w.transfer, layout, destination, w.config.cluster.kv_transfer_timeout_s)
        finished = False
        try:
            with tracer.start_as_current_span("prefill.kv_copy") as span:
                copy = await self._copy_prefix(request, prompt)
                span.set_attributes(_copy_attributes(request, copy))
            with tracer.start_as_current_span("prefill.compute") as span:
                imported = copy.imported if copy is not None else None
                computing = w.engine.generate(rid, prompt, params, prefill_only=True, imported=imported)
                async with contextlib.aclosing(computing) as outputs:
                    async for out in outputs:
                        if not out.finished:  # a chunk is done: send its complete blocks while the next computes
                            streamer.send_upto(out.block_ids, out.num_computed_tokens // layout.block_size)
                finished = out.finished
                prefill_seconds = time.perf_counter() - start
                span.set_attributes({"kvconductor.prompt_tokens": len(prompt),
                                     "kvconductor.cached_tokens": out.num_cached_tokens,
                                     "kvconductor.computed_tokens": len(prompt) - out.num_cached_tokens})  # fmt: skip
            with tracer.start_as_current_span("prefill.kv_transfer") as span:
                streamer.send_upto(out.block_ids, len(destination.block_addresses))
                await streamer.finish()
                exposed_seconds = time.perf_counter() - start - prefill_seconds
                span.set_attributes(streamer.attributes(exposed_seconds))
        finally:
            # Shielded: a cancelled caller must not cut the cleanup short and leave blocks held.
            await asyncio.shield(self._settle(rid, streamer, finished))
        metrics.observe_transfer("send", streamer.bytes, streamer.seconds)
        if copy is not None and copy.bytes:
            metrics.observe_transfer("copy", copy.bytes, copy.seconds)
        await w.publish_kv_events()
        if w.store is not None:
            spawn(self._write_through(prompt), "write-through to the Store")  # served; on failure the Store misses out
        return prefill_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=len(prompt) - out.num_cached_tokens,
            kv_bytes_sent=streamer.bytes,
            kv_blocks_sent=streamer.blocks,
            prefill_seconds=prefill_seconds,
            transfer_seconds=streamer.seconds,
            transfer_exposed_seconds=exposed_seconds,
            copied_tokens=copy.num_copied * w.engine.layout.block_size if copy else 0,
            copy_bytes=copy.bytes if copy else 0,
            copy_seconds=copy.seconds if copy else 0.0,
            copy_note=copy.note if copy else "",
        )

    async def _prefill_by_connector(
        self, request: prefill_pb2.PrefillRequest, prompt: list[int], params: SamplingParams
    ) -> prefill_pb2.PrefillResponse:
        """An engine with its own KV connector: compute the prompt, and the engine pushes its KV.

        The decode request, queued by Reserve on the decode worker, names this worker as its KV's source. The
        reply carries the pushes the connector timed since the last one (earlier requests' KV, mostly: a push
        follows its prefill), from which the Conductor learns this worker's send link. A planned copy pulls
        the prefix's blocks through the connector first (``pull_by_connector``).
        """
        w, rid = self.worker, request.request_id
        start = time.perf_counter()
        copy = None
        num_blocks = min(request.copy_num_blocks, (len(prompt) - 1) // w.engine.layout.block_size)
        from_store = request.HasField("copy_source") and request.copy_source.tier == common_pb2.KV_TIER_STORE
        if num_blocks and from_store:
            copy = store_load_by_connector(w, prompt, num_blocks)
            w.engine.take_store_loads()  # earlier prompts' reads
        elif num_blocks and request.HasField("copy_source"):
            with tracer.start_as_current_span("prefill.kv_copy") as span:
                copy = await pull_by_connector(w, prompt, num_blocks, request.copy_source)
                span.set_attributes(_copy_attributes(request, copy))
            if copy.bytes:
                metrics.observe_transfer("copy", copy.bytes, copy.seconds)
        with tracer.start_as_current_span("prefill.compute") as span:
            async with contextlib.aclosing(w.engine.generate(rid, prompt, params, prefill_only=True)) as outputs:
                async for out in outputs:  # noqa: B007 - the last output has token 0
                    pass
            span.set_attributes({"kvconductor.prompt_tokens": len(prompt),
                                 "kvconductor.cached_tokens": out.num_cached_tokens})  # fmt: skip
        if copy is not None and from_store:
            with tracer.start_as_current_span("prefill.kv_copy") as span:
                store_id = request.copy_source.instance_id
                loads = w.engine.take_store_loads()
                await settle_store_load(w, copy, prompt, num_blocks, out.num_cached_tokens, store_id, loads)
                span.set_attributes(_copy_attributes(request, copy))
        await w.publish_kv_events()
        return prefill_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=len(prompt) - out.num_cached_tokens,
            prefill_seconds=time.perf_counter() - start,
            kv_pushes=[prefill_pb2.KVPush(bytes=b, seconds=t) for b, t in w.engine.take_kv_pushes()],
            copied_tokens=copy.num_copied * w.engine.layout.block_size if copy else 0,
            copy_bytes=copy.bytes if copy else 0,
            copy_seconds=copy.seconds if copy else 0.0,
            copy_note=copy.note if copy else "",
        )

    async def _settle(self, rid: str, streamer: KVStreamer, finished: bool) -> None:
        """After a prefill: no write may land in the decode worker's blocks after we answer; free the blocks."""
        await streamer.settle()
        if finished:  # the KV reached decode (or never will): the blocks stay in the prefix cache
            await self.worker.engine.release(rid)
        else:
            await self.worker.engine.abort(rid)

    async def ExportBlocks(  # noqa: N802
        self, request: prefill_pb2.ExportBlocksRequest, context: Any
    ) -> prefill_pb2.ExportBlocksResponse:
        """Pin cached blocks for a peer to read."""
        return await self.exports.export(request)

    async def ReleaseBlocks(  # noqa: N802
        self, request: prefill_pb2.ReleaseBlocksRequest, context: Any
    ) -> prefill_pb2.ReleaseBlocksResponse:
        """Unpin an export."""
        return prefill_pb2.ReleaseBlocksResponse(released=await self.exports.release(request.export_id))

    def _check_destination(self, destination: common_pb2.KVBlockTarget, num_prompt_tokens: int) -> None:
        num_blocks = self.worker.engine.layout.num_blocks_for(num_prompt_tokens)
        if len(destination.block_addresses) != num_blocks:
            raise ValueError(
                f"destination has {len(destination.block_addresses)} blocks, the prompt needs {num_blocks}"
            )
        bytes_per_block = self.worker.engine.layout.bytes_per_block
        if destination.bytes_per_block != bytes_per_block:
            raise ValueError(
                f"KV layout mismatch: destination blocks are {destination.bytes_per_block} bytes, "
                f"ours {bytes_per_block}"
            )

    async def _copy_prefix(self, request: prefill_pb2.PrefillRequest, prompt: list[int]) -> PrefixCopy | None:
        """Pull the planned prefix blocks this worker lacks from the copy source."""
        if not request.HasField("copy_source") or request.copy_num_blocks == 0:
            return None
        w = self.worker
        block_size = w.engine.layout.block_size
        num_blocks = min(request.copy_num_blocks, (len(prompt) - 1) // block_size)
        copy = PrefixCopy(ImportedBlocks(prefix_block_hashes(prompt[: num_blocks * block_size], block_size), prompt))
        try:
            await copy.prepare(w.engine)
            if request.copy_source.tier == common_pb2.KV_TIER_STORE:
                await pull_from_store(w, copy, request.copy_source.instance_id)
            else:
                await pull_prefix(w, copy, prompt, request.copy_source)
        except BaseException:
            await w.engine.abandon_import(copy.imported)
            raise
        return copy


def _copy_attributes(
    request: prefill_pb2.PrefillRequest, copy: PrefixCopy | ConnectorCopy | None
) -> dict[str, str | int | float]:
    if copy is None:
        return {"kvconductor.copy.planned": 0}
    gbps = copy.bytes / copy.seconds / 1e9 if copy.seconds else 0.0
    return {
        "kvconductor.copy.planned": request.copy_num_blocks,
        "kvconductor.copy.source": request.copy_source.instance_id,
        "kvconductor.copy.own_blocks": copy.num_own,
        "kvconductor.copy.copied_blocks": copy.num_copied,
        "kvconductor.copy.bytes": copy.bytes,
        "kvconductor.copy.seconds": copy.seconds,
        "kvconductor.copy.gbps": gbps,
        "kvconductor.copy.note": copy.note,
    }


def services(worker: Worker) -> tuple[list[Service], PrefillServicer]:
    """Everything a prefill worker serves (and the servicer, whose expiry task the caller runs)."""
    servicer = PrefillServicer(worker)
    prefill = Service("kvconductor.v1.Prefill", servicer, prefill_pb2_grpc.add_PrefillServicer_to_server)
    return [prefill, *worker.services()], servicer
