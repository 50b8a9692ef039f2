"""The kvmeta service: the global KV index, fed by workers' events and pruned by etcd leases.

Both tiers: each worker's engine pool (the worker's own events, in sequence) and the Mooncake Store (the
store service's instance id, fed by every worker that puts blocks or finds them gone).

Invariants:

* Only registered instances are indexed. kvmeta follows the cluster's etcd registrations (``follow``);
  events from an instance it has not seen registered are refused with FAILED_PRECONDITION, so nothing
  enters the index that a lease will not take out again. A worker that publishes before kvmeta's watch
  saw its record (start-up) is refused and gets in at its next heartbeat with its full inventory.
* When a registration goes (lease ended: crash, drain, partition), everything kvmeta holds for the
  instance goes with it: its blocks, its sequence number, a half-received chunked resync. The Mooncake
  Store is the exception: its objects live in the master and the workers' segments, not in the store
  service, so its entries wait ``[store] index_grace_s`` for the service to register again. Back with the
  same master start (``generation``) they stand; with a new one, or not back in time, they go.
* A full inventory too large for one message comes in chunks (services/kvmeta/resync.py): while they
  arrive the instance's entries only grow, and at the last chunk they become exactly the inventory.
* Conductors follow the index (services/kvmeta/followers.py): a snapshot, then every change in the order it
  was applied; they match prompts against their own replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvconductor.v1 import common_pb2, kvmeta_pb2, kvmeta_pb2_grpc
from scheduler.kv_index import KVIndex
from services.common.config import StoreConfig
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent, Registry, RegistryWatch
from services.common.rpc import RpcError, Service
from services.kvmeta.followers import Followers
from services.kvmeta.resync import ChunkedResyncs, ChunkGap

log = logging.getLogger(__name__)


class KvMetaServicer(kvmeta_pb2_grpc.KvMetaServicer):
    """``KvMeta.PublishEvents``, ``Follow`` and ``MatchPrefix``."""

    def __init__(self, store_grace_s: float = StoreConfig.index_grace_s) -> None:
        self.store_grace_s = store_grace_s
        self.index = KVIndex()
        self.resyncs = ChunkedResyncs(self.index)
        self.followers = Followers(self.index)
        self.registered: dict[str, str] = {}  # instance id -> role, as the etcd watch last saw them
        self._store_generation: dict[str, int] = {}  # store service -> the start of its master indexed
        self._store_gone: dict[str, asyncio.TimerHandle] = {}  # store service unregistered -> its entries' drop

    async def PublishEvents(  # noqa: N802
        self, request: kvmeta_pb2.PublishEventsRequest, context: Any
    ) -> kvmeta_pb2.PublishEventsResponse:
        """Apply a worker's event batch (or one chunk of its full inventory)."""
        instance = request.instance_id
        if not instance:
            raise ValueError("instance_id is required")
        if instance not in self.registered:
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance {instance!r} is not registered in this cluster's etcd (or kvmeta has not seen its "
                "record yet): its KV events are refused until it is",
            )
        if request.tier == common_pb2.KV_TIER_STORE:
            self.index.update(instance, request.stored_block_hashes, request.removed_block_hashes)
            return kvmeta_pb2.PublishEventsResponse()
        if request.full_inventory and request.num_chunks > 1:
            return self._chunk(request)
        self.resyncs.discard(instance)  # the chunks of a resync come back to back: anything else abandons it
        resync = self.index.apply(
            instance, request.seq, request.stored_block_hashes, request.removed_block_hashes,
            full=request.full_inventory,
        )  # fmt: skip
        if resync:
            log.info("event gap from %s at seq %d: asking for its inventory", instance, request.seq)
        return kvmeta_pb2.PublishEventsResponse(resync_required=resync)

    def _chunk(self, request: kvmeta_pb2.PublishEventsRequest) -> kvmeta_pb2.PublishEventsResponse:
        """Apply one chunk of a full inventory (added at once; the blocks it did not name go at the last)."""
        instance = request.instance_id
        try:
            done = self.resyncs.add(
                instance, request.seq, request.chunk_index, request.num_chunks, request.stored_block_hashes
            )
        except ChunkGap as e:
            log.info("%s: asking for the inventory again", e)
            return kvmeta_pb2.PublishEventsResponse(resync_required=True)
        if done:
            log.info("%s resynced: %d blocks in %d chunks", instance, self.index.num_blocks(instance),
                     request.num_chunks)  # fmt: skip
        return kvmeta_pb2.PublishEventsResponse()

    async def Follow(  # noqa: N802
        self, request: kvmeta_pb2.FollowRequest, context: Any
    ) -> AsyncIterator[kvmeta_pb2.IndexChange]:
        """The index as a snapshot, then its changes as they are applied."""
        async for change in self.followers.follow():
            yield change

    async def MatchPrefix(  # noqa: N802
        self, request: kvmeta_pb2.MatchPrefixRequest, context: Any
    ) -> kvmeta_pb2.MatchPrefixResponse:
        """Prefix match of a prompt's blocks on every instance (for tools: the Conductors match in process)."""
        match = self.index.match_prefix(list(request.block_hashes), request.instance_ids)
        return kvmeta_pb2.MatchPrefixResponse(
            matches=[kvmeta_pb2.PrefixMatch(instance_id=i, prefix_blocks=n) for i, n in match.prefix_blocks.items()],
            best_blocks=match.best_blocks,
            best_instance_id=match.best_instance,
        )

    def on_instance_event(self, event: InstanceEvent) -> None:
        """Follow the registrations; drop an instance's blocks when its registration disappears (crash or drain).

        The Store's entries go when its master starts again (a new master holds nothing), or when the store
        service stays unregistered for ``store_grace_s`` (called on the running event loop).
        """
        instance = event.instance_id
        if event.kind == "delete":
            self.registered.pop(instance, None)
            self.resyncs.discard(instance)
            if instance in self._store_generation and self.store_grace_s > 0:
                if (gone := self._store_gone.get(instance)) is not None:
                    gone.cancel()
                self._store_gone[instance] = asyncio.get_running_loop().call_later(
                    self.store_grace_s, self._forget, instance, f"stayed unregistered {self.store_grace_s:.0f} s"
                )
                log.info("store service %s unregistered: its index waits %.0f s for the same master to come back",
                         instance, self.store_grace_s)  # fmt: skip
            else:
                self._forget(instance, "left")
            return
        self.registered[instance] = event.role
        if isinstance(event.record, StoreRecord):
            if (gone := self._store_gone.pop(instance, None)) is not None:
                gone.cancel()
            known = self._store_generation.get(instance)
            self._store_generation[instance] = event.record.generation
            if known is not None and known != event.record.generation:
                dropped = self.index.drop_instance(instance)
                log.info("the Store's master started again (generation %d): dropped its %d blocks",
                         event.record.generation, dropped)  # fmt: skip

    def _forget(self, instance: str, why: str) -> None:
        """Drop everything indexed for an unregistered instance."""
        self._store_gone.pop(instance, None)
        self._store_generation.pop(instance, None)
        dropped = self.index.drop_instance(instance)
        log.info("instance %s %s: dropped %d blocks", instance, why, dropped)

    def follow(self, registry: Registry) -> RegistryWatch:
        """Watch ``registry``'s instances, applying each change on the running event loop (the handlers' own)."""
        loop = asyncio.get_running_loop()

        def on_event(event: InstanceEvent) -> None:
            loop.call_soon_threadsafe(self.on_instance_event, event)

        return registry.watch(on_event)


def services(servicer: KvMetaServicer) -> list[Service]:
    """What kvmeta serves."""
    return [Service("kvconductor.v1.KvMeta", servicer, kvmeta_pb2_grpc.add_KvMetaServicer_to_server)]
