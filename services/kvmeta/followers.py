"""The Conductors that follow kvmeta's index: a snapshot, then every change as it is applied.

A Conductor matches each prompt against its own replica of the index instead of asking kvmeta per
request (a 100k-token prompt is 6,250 block hashes, about 200 KB, each way of a call). Invariants:

* A follower sees every change after its snapshot and none twice: the snapshot is copied and the follower
  registered in one step of kvmeta's event loop, and the index reports each change as it applies it
  (``KVIndex.follower``), so a change is either in the snapshot or in the follower's queue.
* Changes reach every follower in the order kvmeta applied them; each change message is built once and
  shared by all followers.
* A follower's queue is bounded (``FOLLOW_QUEUE`` messages). One that falls that far behind is cut off
  (RESOURCE_EXHAUSTED) and follows again from a new snapshot: kvmeta never holds unbounded memory for a
  slow Conductor, and never blocks the workers' events on one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator

import grpc

from kvconductor.v1 import kvmeta_pb2
from scheduler.kv_index import KVIndex
from services.common.hash_batches import chunks
from services.common.rpc import RpcError

FOLLOW_QUEUE = 4096  # change messages a follower may lag behind before it is cut off


def change_messages(instance: str, gained: list[bytes], lost: list[bytes]) -> Iterator[kvmeta_pb2.IndexChange]:
    """One change as messages within gRPC's size limit (blocks lost first, then blocks gained)."""
    for part in chunks(lost) if lost else ():
        yield kvmeta_pb2.IndexChange(instance_id=instance, removed_block_hashes=part)
    for part in chunks(gained) if gained else ():
        yield kvmeta_pb2.IndexChange(instance_id=instance, stored_block_hashes=part)


class _Follower:
    def __init__(self) -> None:
        self.queue: collections.deque[kvmeta_pb2.IndexChange] = collections.deque()
        self.ready = asyncio.Event()
        self.overflowed = False


class Followers:
    """The followers of ``index``; ``follow`` is the body of ``KvMeta.Follow``."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._followers: set[_Follower] = set()
        index.follower = self._changed

    def __len__(self) -> int:
        return len(self._followers)

    def _changed(self, instance: str, gained: list[bytes], lost: list[bytes], dropped: bool) -> None:
        if not self._followers:
            return
        messages = (
            [kvmeta_pb2.IndexChange(instance_id=instance, dropped=True)]
            if dropped
            else list(change_messages(instance, gained, lost))
        )
        for follower in self._followers:
            if follower.overflowed:
                continue
            if len(follower.queue) + len(messages) > FOLLOW_QUEUE:
                follower.overflowed = True
                follower.queue.clear()
            else:
                follower.queue.extend(messages)
            follower.ready.set()

    async def follow(self) -> AsyncIterator[kvmeta_pb2.IndexChange]:
        """The snapshot, the synced marker, then every change until the caller goes (or falls too far behind)."""
        follower = _Follower()
        snapshot = self.index.inventories()  # with the registration below, in one step of the loop
        self._followers.add(follower)
        try:
            for instance, blocks in snapshot:
                for message in change_messages(instance, blocks, []):
                    yield message
            yield kvmeta_pb2.IndexChange(synced=True)
            while True:
                await follower.ready.wait()
                follower.ready.clear()
                if follower.overflowed:
                    raise RpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this follower fell {FOLLOW_QUEUE} changes behind the index: follow again from a snapshot",
                    )
                while follower.queue:
                    yield follower.queue.popleft()
        finally:
            self._followers.discard(follower)
