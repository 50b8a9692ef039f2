"""Streams a prompt's KV to the decode worker chunk by chunk, while later chunks still compute.

A long prompt is prefilled in chunks of ``max_num_batched_tokens``; after each chunk the engine reports
the blocks computed so far. Every block that is complete is final, so it is written into the decode
worker's reserved block at once, on a worker thread (the transfer releases the GIL), while the engine
computes the next chunk. Only the blocks of the last chunk (the partial tail block included) remain
to send after token 0, so the transfer adds to TTFT only that tail, not the whole prompt (Mooncake's
layer-wise streaming, at chunk granularity)::

    compute  [chunk 0][chunk 1][chunk 2]|token 0
    transfer          [  0   ][   1    ][ 2 ]      <- exposed: only the last piece

Writes are issued in order, one batch at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc

from kvconductor.v1 import common_pb2
from services.common.rpc import KV_TRANSFER_FAILED, RpcError
from services.worker.engines.port import KVLayout
from services.worker.kv.transfer import KVTransferEngine, TransferError


class KVStreamer:
    """Sends a request's prompt blocks into a destination as they become final."""

    def __init__(
        self, transfer: KVTransferEngine, layout: KVLayout, destination: common_pb2.KVBlockTarget, timeout_s: float
    ) -> None:
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.layout = layout
        self.destination = destination
        self.sent = 0  # leading blocks handed to the transfer engine
        self.bytes = 0
        self.blocks = 0
        self.seconds = 0.0  # time spent writing, summed over batches
        self._last: asyncio.Task[None] | None = None

    def send_upto(self, block_ids: Sequence[int], num_blocks: int) -> None:
        """Queue blocks ``sent..num_blocks-1`` of the request (their KV must be final)."""
        num_blocks = min(num_blocks, len(self.destination.block_addresses))
        if num_blocks <= self.sent:
            return
        sources = [self.layout.block_address(b) for b in block_ids[self.sent : num_blocks]]
        targets = list(self.destination.block_addresses[self.sent : num_blocks])
        self.sent = num_blocks
        self._last = asyncio.ensure_future(self._write(self._last, sources, targets))

    async def _write(self, previous: asyncio.Task[None] | None, sources: list[int], targets: list[int]) -> None:
        if previous is not None:
            await previous
        start = time.perf_counter()
        write = asyncio.to_thread(
            self.transfer.write_blocks, self.destination.transfer_endpoint, sources, targets,
            self.destination.bytes_per_block,
        )  # fmt: skip
        try:
            result = await asyncio.wait_for(write, self.timeout_s)
        except TimeoutError:
            raise TransferError(f"no completion within {self.timeout_s:g} s (kv_transfer_timeout_s)") from None
        self.seconds += time.perf_counter() - start
        self.bytes += result.bytes
        self.blocks += result.blocks

    async def finish(self) -> None:
        """Wait until every queued write is done; a failed or timed-out write raises UNAVAILABLE."""
        if self._last is None:
            return
        try:
            await self._last
        except TransferError as e:
            endpoint = self.destination.transfer_endpoint
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{KV_TRANSFER_FAILED} to {endpoint}: {e}") from e

    def attributes(self, exposed_seconds: float) -> dict[str, int | float | str]:
        """Span attributes of the whole transfer."""
        return {
            "kvconductor.kv.bytes": self.bytes,
            "kvconductor.kv.blocks": self.blocks,
            "kvconductor.kv.seconds": self.seconds,
            "kvconductor.kv.exposed_seconds": exposed_seconds,
            "kvconductor.kv.gbps": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
            "kvconductor.kv.destination": self.destination.transfer_endpoint,
        }

    async def settle(self) -> None:
        """Wait for queued writes whatever happens, ignoring their errors (cleanup after a failure)."""
        if self._last is not None:
            await asyncio.gather(self._last, return_exceptions=True)
