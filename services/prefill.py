"""The prefill worker: runs prompts with prefix reuse and writes their KV straight into a decode worker.

Per request::

    add_request(prefill_only) -> engine computes the uncached blocks, samples token 0
    -> transfer engine writes every prompt block (the last, partial one included) into the decode
       worker's reserved blocks -> release the blocks (they stay in the prefix cache) -> announce
       newly stored / evicted blocks to kvmeta -> reply with token 0

The reply comes after the announcement, so a request that follows this one can already be routed to
the prefix it left behind.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvconductor.v1 import prefill_pb2, prefill_pb2_grpc
from services.engine_loop import next_output
from services.rpc import Service
from services.worker import Worker, sampling_from_proto


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """``Prefill.Prefill``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:  # noqa: N802
        """Compute the prompt, send its KV to the destination blocks, return the first token."""
        w, rid = self.worker, request.request_id
        prompt, params = list(request.prompt_token_ids), sampling_from_proto(request.sampling)
        destination = request.destination
        num_blocks = w.num_kv_blocks(len(prompt))
        bytes_per_block = w.engine.kv_pool.bytes_per_block
        if len(destination.block_addresses) != num_blocks:
            raise ValueError(
                f"destination has {len(destination.block_addresses)} blocks, the prompt needs {num_blocks}"
            )
        if destination.bytes_per_block != bytes_per_block:
            raise ValueError(
                f"KV layout mismatch: destination blocks are {destination.bytes_per_block} bytes, "
                f"ours {bytes_per_block}"
            )
        start = time.perf_counter()
        outputs = w.loop.open(rid)
        finished = False
        try:
            await w.loop.call(lambda e: e.add_request(rid, prompt, params, prefill_only=True))
            out = await next_output(outputs)
            while not out.finished:  # chunked prefill may report progress before token 0
                out = await next_output(outputs)
            finished = True
            prefill_seconds = time.perf_counter() - start
            sources = [w.engine.kv_pool.block_address(b) for b in out.block_ids[:num_blocks]]
            result = await asyncio.to_thread(
                w.transfer.write_blocks,
                destination.transfer_endpoint,
                sources,
                list(destination.block_addresses),
                bytes_per_block,
            )
        finally:
            w.loop.close(rid)
            await w.loop.call(lambda e: e.release(rid) if finished else e.abort(rid))
        w.counters.bytes_sent += result.bytes
        w.counters.blocks_sent += result.blocks
        await w.publish_kv_events()
        return prefill_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0],
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=len(prompt) - out.num_cached_tokens,
            kv_bytes_sent=result.bytes,
            kv_blocks_sent=result.blocks,
            prefill_seconds=prefill_seconds,
            transfer_seconds=result.seconds,
        )


def services(worker: Worker) -> list[Service]:
    """Everything a prefill worker serves."""
    prefill = Service("kvconductor.v1.Prefill", PrefillServicer(worker), prefill_pb2_grpc.add_PrefillServicer_to_server)
    return [prefill, *worker.services()]
