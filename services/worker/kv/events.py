"""Publishes a worker's KV events (blocks stored / evicted) to every kvmeta replica.

Every call carries the next per-instance sequence number. When a kvmeta reports a gap (it restarted, or a
call was lost) or a call fails, the next publish to that replica sends the full inventory instead of a
delta, so each index converges without the worker ever failing a request because a kvmeta is away. The
replicas are the kvmeta instances registered in etcd, re-listed at every heartbeat: a new replica gets the
full inventory within one heartbeat, and losing one leaves the others' indexes whole.

A delta whose call timed out (a kvmeta too busy to answer within ``timeout_s``, which may or may not have
applied it) is not followed by the full inventory: it is sent again, under its own number, before the next
delta, and kvmeta takes a number it has already applied as done (``KVIndex.apply``). Answering a slow kvmeta
with full inventories (190,464 blocks from a full emulated pool) made it slower: sixteen workers' resyncs kept
it busy for minutes after a burst (`bench compare --routers`, 2026-12-07). The deltas kept for resending are
bounded by the same budget; past it, the inventory goes instead.

A full inventory goes in chunks of at most ``MESSAGE_BUDGET`` bytes of block hashes (a pool of 190,464
blocks is 6.2 MiB, over gRPC's 4 MiB limit), counted from each entry's wire size; kvmeta adds each chunk's
blocks and, at the last chunk, removes those the inventory lacks (services/kvmeta/resync.py). A delta over
the budget is sent as a full inventory instead. A kvmeta that
refuses the events (FAILED_PRECONDITION: it has not seen this instance registered yet) is treated like
an unreachable one: the full inventory goes again at the next publish or heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from kvconductor.v1 import common_pb2, kvmeta_pb2, kvmeta_pb2_grpc
from services.common.hash_batches import MESSAGE_BUDGET, chunks, entry_bytes
from services.common.registry import Registry
from services.common.rpc import channel

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One kvmeta: its channel, and whether it needs the full inventory next."""

    address: str
    channel: grpc.aio.Channel
    resync: bool = True
    failing: bool = False  # the last call failed (logged once per outage, not at every retry)
    # deltas whose call timed out, each with its hashes' wire size
    unanswered: list[tuple[kvmeta_pb2.PublishEventsRequest, int]] = field(default_factory=list)

    @property
    def stub(self) -> kvmeta_pb2_grpc.KvMetaStub:
        """Stub of KvMeta."""
        return kvmeta_pb2_grpc.KvMetaStub(self.channel)


class KvEventPublisher:
    """Delta publishing with resync on a gap, to each kvmeta; the worker's inventory is tracked here."""

    def __init__(
        self, registry: Registry, instance_id: str, timeout_s: float = 2.0, budget: int = MESSAGE_BUDGET
    ) -> None:
        self.registry = registry
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.budget = budget
        self.inventory: set[bytes] = set()
        self._seq = 0
        self._replicas: dict[str, Replica] = {}  # kvmeta instance id -> replica
        self._listed = False
        self._lock = asyncio.Lock()

    async def publish(self, stored: Iterable[bytes], removed: Iterable[bytes], heartbeat: bool = False) -> None:
        """Apply the delta locally and send it (or the full inventory after a gap) to every replica.

        An empty delta is sent only as a ``heartbeat``: it lets a restarted kvmeta, which no longer
        knows this instance, ask for the inventory even while the worker is idle; the heartbeat also
        re-lists the replicas.
        """
        stored, removed = list(stored), list(removed)
        self.inventory.difference_update(removed)
        self.inventory.update(stored)
        resync = any(r.resync for r in self._replicas.values())
        if not stored and not removed and not resync and not heartbeat and self._listed:
            return
        async with self._lock:  # one call at a time: sequence numbers arrive in order, each in every replica
            if heartbeat or not self._listed:
                await self._list()
            self._seq += 1
            delta = kvmeta_pb2.PublishEventsRequest(
                instance_id=self.instance_id, seq=self._seq, stored_block_hashes=stored, removed_block_hashes=removed
            )
            size = sum(map(entry_bytes, stored)) + sum(map(entry_bytes, removed))
            await asyncio.gather(*(self._send(r, delta, size) for r in self._replicas.values()))

    async def publish_store(self, store_id: str, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Tell every kvmeta which blocks this worker put into the Mooncake Store (``store_id``'s) or found gone.

        No sequence and no resync: the Store's entries are a set many workers add to; a lost call leaves
        blocks out of the index (or a stale entry whose read then misses), never a wrong match.
        """
        if not stored and not removed:
            return
        request = kvmeta_pb2.PublishEventsRequest(
            instance_id=store_id, stored_block_hashes=list(stored), removed_block_hashes=list(removed),
            tier=common_pb2.KV_TIER_STORE,
        )  # fmt: skip

        async def send(replica: Replica) -> None:
            try:
                await replica.stub.PublishEvents(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                log.warning("kvmeta at %s unreachable for the Store's entries (%s)", replica.address, _reason(e))

        async with self._lock:
            if not self._listed:
                await self._list()
            await asyncio.gather(*(send(r) for r in self._replicas.values()))

    async def _send(self, replica: Replica, delta: kvmeta_pb2.PublishEventsRequest, size: int) -> None:
        """The deltas unanswered so far, then ``delta`` (``size``: its hashes' wire bytes).

        The full inventory instead when the replica is owed it or the deltas are over the budget.
        """
        pending = [*replica.unanswered, (delta, size)]
        replica.unanswered = []
        if not replica.resync and sum(n for _, n in pending) <= self.budget:
            for i, (request, _) in enumerate(pending):
                response = await self._call(replica, request)
                if response is None:
                    if not replica.resync:  # timed out: kvmeta may have it; sent again before the next delta
                        replica.unanswered = pending[i:]
                    return
                if response.resync_required:
                    break  # the gap is this replica's: the inventory goes to it alone, under the latest number
            else:
                return
        await self._resync(replica, delta.seq)

    async def _resync(self, replica: Replica, seq: int) -> None:
        """The full inventory under ``seq``, in chunks within the budget; ``replica.resync`` clears once all landed.

        A failed or refused chunk leaves ``resync`` set: the next publish (at the latest the next heartbeat)
        starts over at chunk 0, and kvmeta keeps the inventory it had until a resync completes.
        """
        replica.resync = True
        parts = chunks(sorted(self.inventory), self.budget)
        for index, part in enumerate(parts):
            request = kvmeta_pb2.PublishEventsRequest(
                instance_id=self.instance_id, seq=seq, stored_block_hashes=part, full_inventory=True,
                chunk_index=index, num_chunks=len(parts),
            )  # fmt: skip
            response = await self._call(replica, request)
            if response is None:
                return
            if response.resync_required:  # kvmeta lost the chunks staged so far (it restarted)
                log.info("kvmeta at %s dropped chunk %d of our inventory; resending it", replica.address, index)
                return
        replica.resync = False

    async def _call(
        self, replica: Replica, request: kvmeta_pb2.PublishEventsRequest
    ) -> kvmeta_pb2.PublishEventsResponse | None:
        """One PublishEvents; None when it failed or kvmeta refused it, with ``resync`` set unless it timed out."""
        try:
            response: kvmeta_pb2.PublishEventsResponse = await replica.stub.PublishEvents(
                request, timeout=self.timeout_s
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            task = asyncio.current_task()
            if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
                raise  # our caller is being cancelled; a call cancelled under us (closed channel) is kvmeta's
            level = logging.DEBUG if replica.failing else logging.WARNING
            timed_out = isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            then = "will send those events again" if timed_out else "will resend the full inventory"
            log.log(level, "kvmeta at %s: %s; %s", replica.address, _reason(e), then)
            replica.failing = True
            replica.resync = replica.resync or not timed_out
            return None
        if replica.failing:
            log.info("kvmeta at %s takes our events again", replica.address)
            replica.failing = False
        return response

    async def _list(self) -> None:
        """Follow the registered kvmeta instances (a channel to each new one; closed for those gone)."""
        try:
            listed = await asyncio.to_thread(self.registry.list, "kvmeta")
        except ConnectionError as e:
            log.warning("etcd unreachable listing kvmeta (%s); publishing to the replicas known", e)
            return
        self._listed = True
        current = {instance_id: record.address for (_, instance_id), record in listed.items()}
        for instance_id in list(self._replicas):
            replica = self._replicas[instance_id]
            if current.get(instance_id) != replica.address:
                del self._replicas[instance_id]
                await replica.channel.close()
        for instance_id, address in current.items():
            if instance_id not in self._replicas:
                self._replicas[instance_id] = Replica(address, channel(address))

    async def close(self) -> None:
        """Close the channels."""
        for replica in self._replicas.values():
            await replica.channel.close()
        self._replicas.clear()


def _reason(error: BaseException) -> str:
    if not isinstance(error, grpc.aio.AioRpcError):
        return "call cancelled"
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION:  # refused: say why (not registered yet)
        return f"{error.code().name} ({error.details()})"
    return str(error.code().name)
