"""The kvmeta service: the global KV index, fed by workers' events and pruned by etcd leases.

Both tiers: each worker's engine pool (the worker's own events, in sequence) and the Mooncake Store (the
store service's instance id, fed by every worker that puts blocks or finds them gone).
"""

from __future__ import annotations

import logging
from typing import Any

from kvconductor.v1 import common_pb2, kvmeta_pb2, kvmeta_pb2_grpc
from scheduler.kv_index import KVIndex
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent
from services.common.rpc import Service

log = logging.getLogger(__name__)


class KvMetaServicer(kvmeta_pb2_grpc.KvMetaServicer):
    """``KvMeta.PublishEvents`` and ``KvMeta.MatchPrefix``."""

    def __init__(self) -> None:
        self.index = KVIndex()
        self._store_generation: dict[str, int] = {}  # store service -> the start of its master indexed

    async def PublishEvents(  # noqa: N802
        self, request: kvmeta_pb2.PublishEventsRequest, context: Any
    ) -> kvmeta_pb2.PublishEventsResponse:
        """Apply a worker's event batch."""
        if not request.instance_id:
            raise ValueError("instance_id is required")
        if request.tier == common_pb2.KV_TIER_STORE:
            self.index.update(request.instance_id, request.stored_block_hashes, request.removed_block_hashes)
            return kvmeta_pb2.PublishEventsResponse()
        resync = self.index.apply(
            request.instance_id,
            request.seq,
            request.stored_block_hashes,
            request.removed_block_hashes,
            full=request.full_inventory,
        )
        if resync:
            log.info("event gap from %s at seq %d: asking for its inventory", request.instance_id, request.seq)
        return kvmeta_pb2.PublishEventsResponse(resync_required=resync)

    async def MatchPrefix(  # noqa: N802
        self, request: kvmeta_pb2.MatchPrefixRequest, context: Any
    ) -> kvmeta_pb2.MatchPrefixResponse:
        """Prefix match of a prompt's blocks on every instance."""
        match = self.index.match_prefix(list(request.block_hashes), request.instance_ids)
        return kvmeta_pb2.MatchPrefixResponse(
            matches=[kvmeta_pb2.PrefixMatch(instance_id=i, prefix_blocks=n) for i, n in match.prefix_blocks.items()],
            best_blocks=match.best_blocks,
            best_instance_id=match.best_instance,
        )

    def on_instance_event(self, event: InstanceEvent) -> None:
        """Drop an instance's blocks when its registration disappears (crash or drain).

        The Store's entries go too when its master starts again: a new master holds nothing.
        """
        if event.kind == "delete":
            self._store_generation.pop(event.instance_id, None)
            dropped = self.index.drop_instance(event.instance_id)
            log.info("instance %s left: dropped %d blocks", event.instance_id, dropped)
        elif isinstance(event.record, StoreRecord):
            known = self._store_generation.get(event.instance_id)
            self._store_generation[event.instance_id] = event.record.generation
            if known is not None and known != event.record.generation:
                dropped = self.index.drop_instance(event.instance_id)
                log.info("the Store's master restarted (start %d): dropped its %d blocks", event.record.generation,
                         dropped)  # fmt: skip


def services(servicer: KvMetaServicer) -> list[Service]:
    """What kvmeta serves."""
    return [Service("kvconductor.v1.KvMeta", servicer, kvmeta_pb2_grpc.add_KvMetaServicer_to_server)]
