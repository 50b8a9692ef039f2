"""Publishes a worker's KV events (blocks stored / evicted) to kvmeta.

Every call carries the next per-instance sequence number. When kvmeta reports a gap (it restarted, or a
call was lost) or a call fails, the next publish sends the full inventory instead of a delta, so the
index converges without the worker ever failing a request because kvmeta is away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

import grpc

from kvconductor.v1 import common_pb2, kvmeta_pb2, kvmeta_pb2_grpc
from services.common.registry import Registry
from services.common.rpc import channel

log = logging.getLogger(__name__)


class KvEventPublisher:
    """Delta publishing with resync on a gap; the worker's inventory is tracked here."""

    def __init__(self, registry: Registry, instance_id: str, timeout_s: float = 2.0) -> None:
        self.registry = registry
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.inventory: set[bytes] = set()
        self._seq = 0
        self._resync = True
        self._channel: grpc.aio.Channel | None = None
        self._lock = asyncio.Lock()

    async def publish(self, stored: Iterable[bytes], removed: Iterable[bytes], heartbeat: bool = False) -> None:
        """Apply the delta locally and send it (or the full inventory after a gap).

        An empty delta is sent only as a ``heartbeat``: it lets a restarted kvmeta, which no longer
        knows this instance, ask for the inventory even while the worker is idle.
        """
        stored, removed = list(stored), list(removed)
        self.inventory.difference_update(removed)
        self.inventory.update(stored)
        if not stored and not removed and not self._resync and not heartbeat:
            return
        async with self._lock:  # one call at a time: sequence numbers arrive in order, the channel is not shared
            await self._send(stored, removed)

    async def publish_store(self, store_id: str, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Tell kvmeta which blocks this worker put into the Mooncake Store (``store_id``'s) or found gone there.

        No sequence and no resync: the Store's entries are a set many workers add to; a lost call leaves
        blocks out of the index (or a stale entry whose read then misses), never a wrong match.
        """
        if not stored and not removed:
            return
        async with self._lock:
            stub = await self._stub()
            if stub is None:
                return
            request = kvmeta_pb2.PublishEventsRequest(instance_id=store_id, stored_block_hashes=list(stored),
                                                      removed_block_hashes=list(removed),
                                                      tier=common_pb2.KV_TIER_STORE)  # fmt: skip
            try:
                await stub.PublishEvents(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                log.warning("kvmeta unreachable for the Store's entries (%s)", _reason(e))

    async def _send(self, stored: list[bytes], removed: list[bytes]) -> None:
        stub = await self._stub()
        if stub is None:
            self._resync = True
            return
        full = self._resync
        self._seq += 1
        request = kvmeta_pb2.PublishEventsRequest(
            instance_id=self.instance_id,
            seq=self._seq,
            stored_block_hashes=sorted(self.inventory) if full else stored,
            removed_block_hashes=[] if full else removed,
            full_inventory=full,
        )
        try:
            response = await stub.PublishEvents(request, timeout=self.timeout_s)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            task = asyncio.current_task()
            if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # our caller is being cancelled; a call cancelled under us (closed channel) is kvmeta's
            log.warning("kvmeta unreachable (%s); will resend the full inventory", _reason(e))
            self._resync = True
            await self._reset()
            return
        self._resync = response.resync_required
        if self._resync:
            await self._send([], [])

    async def _stub(self) -> kvmeta_pb2_grpc.KvMetaStub | None:
        if self._channel is None:
            instances = await asyncio.to_thread(self.registry.list, "kvmeta")
            if not instances:
                return None
            self._channel = channel(next(iter(instances.values())).address)
            self._resync = True
        return kvmeta_pb2_grpc.KvMetaStub(self._channel)

    async def _reset(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None

    async def close(self) -> None:
        """Close the channel."""
        await self._reset()


def _reason(error: BaseException) -> str:
    return error.code().name if isinstance(error, grpc.aio.AioRpcError) else "call cancelled"
