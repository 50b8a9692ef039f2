"""The Conductor's replica of kvmeta's index: each prompt is matched in the Conductor's own process.

The replica follows one kvmeta (``KvMeta.Follow``: a snapshot, then every change as kvmeta applies it);
any replica of kvmeta will do, since every worker publishes to each. Matching in process takes the
per-request call off the request's path: a 100k-token prompt is 6,250 block hashes, about 200 KB sent
and parsed each way, and the call's round trip was most of the Conductor's time before Algorithm 1.
Invariants:

* A snapshot is read into a fresh index, which replaces the one in use only when it is complete (the
  synced marker): a match never sees half a snapshot.
* Changes are applied in the order kvmeta sent them, on the Conductor's event loop, between requests.
* When the stream breaks, the replica follows the next kvmeta (the one that failed last, for a while)
  from a new snapshot; meanwhile the last index keeps answering for at most ``STALE_S``. After that,
  with no kvmeta followed, matches are empty (the request is scheduled cache-unaware) rather than stale.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence

import grpc

from kvconductor.v1 import kvmeta_pb2, kvmeta_pb2_grpc
from scheduler.kv_index import KVIndex
from services.common import metrics
from services.conductor.cluster_view import ClusterView

log = logging.getLogger(__name__)
STALE_S = 5.0  # how long the last index answers after its stream broke
RETRY_S = 0.5  # between attempts to follow a kvmeta after one failed


class KVReplica:
    """kvmeta's index, followed; ``run`` keeps it current, ``match`` answers from it."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.index = KVIndex()
        self.following = ""  # the kvmeta address whose index this is, once synced
        self._usable_until = 0.0  # monotonic; inf while following

    def match(self, block_hashes: Sequence[bytes], instances: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each of ``instances`` holds (those holding at least one)."""
        if not block_hashes or time.monotonic() > self._usable_until:
            return {}
        return self.index.match_prefix(block_hashes, instances).prefix_blocks

    async def run(self) -> None:
        """Follow a kvmeta for as long as the Conductor runs, the next one whenever a stream breaks."""
        while True:
            replicas = self.view.kvmetas
            if not replicas:
                await self.view.wait_for(lambda: bool(self.view.kvmetas), STALE_S)
                continue
            address, channel = replicas[0]
            try:
                await self._follow(address, channel)
                log.warning("kvmeta at %s ended its index stream", address)
            except grpc.aio.AioRpcError as e:
                log.warning("following kvmeta at %s: %s (%s)", address, e.code().name, e.details())
                self.view.kvmeta_failed(address)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the Conductor stops
                log.warning("kvmeta at %s left: its channel closed under the index stream", address)
            metrics.KV_INDEX_FOLLOWING.set(0)
            if self.following:
                log.warning("the KV index answers as it was for %.0f s more, unless another kvmeta is followed",
                            STALE_S)  # fmt: skip
                self._usable_until = time.monotonic() + STALE_S
                self.following = ""
            await asyncio.sleep(RETRY_S)

    async def _follow(self, address: str, channel: grpc.aio.Channel) -> None:
        index = KVIndex()
        call = kvmeta_pb2_grpc.KvMetaStub(channel).Follow(kvmeta_pb2.FollowRequest())
        async for change in call:
            if change.synced:
                self.index, self.following, self._usable_until = index, address, math.inf
                metrics.KV_INDEX_FOLLOWING.set(1)
                metrics.KV_INDEX_SNAPSHOTS.inc()
                log.info("following the KV index of kvmeta at %s: %d instances", address, len(index.instances()))
            elif change.dropped:
                index.drop_instance(change.instance_id)
            else:
                index.update(change.instance_id, change.stored_block_hashes, change.removed_block_hashes)
