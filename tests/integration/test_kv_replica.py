"""The Conductor's replica of kvmeta's index, over real gRPC: in-process kvmeta servers (port 0) and the replica.

* The replica answers every prompt as kvmeta's own index does: a snapshot larger than one gRPC message,
  then blocks stored and removed, an instance dropped.
* A follower that falls too far behind is cut off and follows again from a new snapshot, ending equal.
* When its kvmeta goes, the last index answers for ``STALE_S``, then nothing (cache-unaware), until another
  kvmeta is followed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common.instance_record import InstanceRecord
from services.common.registry import InstanceEvent
from services.common.rpc import ErrorInterceptor
from services.conductor import kv_replica
from services.conductor.cluster_view import ClusterView
from services.conductor.kv_replica import KVReplica
from services.kvmeta import followers
from services.kvmeta.kvmeta import KvMetaServicer, services

pytestmark = pytest.mark.asyncio(loop_scope="session")
INSTANCES = ("prefill-0", "prefill-1", "store-0")


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).digest() for i in range(n)]


class KvMeta:
    """kvmeta's servicer behind a real gRPC server; events applied directly to its index."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.servicer = KvMetaServicer()
        self.index = self.servicer.index

    async def start(self) -> KvMeta:
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        for s in services(self.servicer):
            s.add_to_server(s.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    def event(self, kind: str = "put") -> InstanceEvent:
        record = InstanceRecord("kvmeta", self.instance_id, f"127.0.0.1:{self.port}") if kind == "put" else None
        return InstanceEvent(kind, "kvmeta", self.instance_id, record)

    async def stop(self) -> None:
        await self.server.stop(0)


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.01)


def same_answers(replica: KVReplica, kvmeta: KvMeta, prompts: list[list[bytes]]) -> bool:
    return all(replica.match(p, INSTANCES) == kvmeta.index.match_prefix(p, INSTANCES).prefix_blocks for p in prompts)


async def following(kvmeta: KvMeta) -> tuple[ClusterView, KVReplica, asyncio.Task[None]]:
    view = ClusterView()
    view.attach(asyncio.get_running_loop())
    view.on_event(kvmeta.event())
    replica = KVReplica(view)
    return view, replica, asyncio.create_task(replica.run())


async def test_the_replica_answers_as_kvmeta_after_a_snapshot_over_one_message_and_every_change():
    kvmeta = await KvMeta("kvmeta-0").start()
    shared, other = _hashes(150_000), _hashes(64, salt=1)  # 150k hashes: 5 MB, over gRPC's 4 MiB limit
    kvmeta.index.apply("prefill-0", 1, shared, [], full=True)
    kvmeta.index.apply("prefill-1", 1, shared[:100], [], full=True)
    _, replica, task = await following(kvmeta)
    try:
        prompts = [shared[:5000], shared[:50] + other, other, shared]
        await until(lambda: replica.following != "", 30, "the snapshot arrived")
        assert replica.match(shared[:5000], INSTANCES) == {"prefill-0": 5000, "prefill-1": 100}
        kvmeta.index.apply("prefill-1", 2, other, shared[40:100])  # stored and removed
        kvmeta.index.update("store-0", shared[:10], [])  # the Store's entries (no sequence)
        await until(lambda: same_answers(replica, kvmeta, prompts), 10, "the changes arrived")
        assert replica.match(shared[:50] + other, INSTANCES) == {"prefill-0": 50, "prefill-1": 40, "store-0": 10}
        assert kvmeta.index.drop_instance("prefill-0") == 150_000  # its lease ended
        await until(lambda: "prefill-0" not in replica.match(shared, INSTANCES), 10, "the drop arrived")
        assert same_answers(replica, kvmeta, prompts)
    finally:
        task.cancel()
        await kvmeta.stop()


async def test_a_follower_that_falls_behind_is_cut_off_and_follows_again_from_a_snapshot(monkeypatch):
    monkeypatch.setattr(followers, "FOLLOW_QUEUE", 8)
    monkeypatch.setattr(kv_replica, "RETRY_S", 0.01)
    kvmeta = await KvMeta("kvmeta-0").start()
    h = _hashes(100)
    _, replica, task = await following(kvmeta)
    try:
        await until(lambda: replica.following != "", 10, "synced")
        first = replica.index
        for i in range(1, 51):  # 50 changes in one step of the loop: the follower cannot keep up
            kvmeta.index.update("prefill-0", [h[i - 1]], [])
        await until(lambda: replica.index is not first and replica.following != "", 10, "followed again")
        assert replica.match(h, INSTANCES) == {"prefill-0": 50}
        assert len(kvmeta.servicer.followers) == 1  # the cut-off follower was let go
    finally:
        task.cancel()
        await kvmeta.stop()


async def test_without_its_kvmeta_the_index_answers_for_a_while_then_not_until_another_is_followed(monkeypatch):
    monkeypatch.setattr(kv_replica, "STALE_S", 0.5)
    monkeypatch.setattr(kv_replica, "RETRY_S", 0.05)
    first, second = await KvMeta("kvmeta-0").start(), await KvMeta("kvmeta-1").start()
    h = _hashes(10)
    for kvmeta in (first, second):  # every worker publishes to each replica
        kvmeta.index.update("prefill-0", h, [])
    view, replica, task = await following(first)
    try:
        await until(lambda: replica.match(h, INSTANCES) == {"prefill-0": 10}, 10, "synced")
        view.on_event(first.event("delete"))  # its lease ended: the view closes its channel under the stream
        stopped = time.monotonic()
        await until(lambda: replica.following == "", 10, "the stream broke")
        if time.monotonic() - stopped < 0.4:  # (a starved machine may take longer to notice than STALE_S)
            assert replica.match(h, INSTANCES) == {"prefill-0": 10}  # the last index still answers
        await until(lambda: replica.match(h, INSTANCES) == {}, 10, "stale: cache-unaware")
        assert REGISTRY.get_sample_value("kvconductor_kv_index_following") == 0  # what an operator alerts on
        snapshots = REGISTRY.get_sample_value("kvconductor_kv_index_snapshots_total")
        await first.stop()
        view.on_event(second.event())
        await until(lambda: replica.following.endswith(f":{second.port}"), 10, "followed the other kvmeta")
        assert replica.match(h, INSTANCES) == {"prefill-0": 10}
        assert REGISTRY.get_sample_value("kvconductor_kv_index_following") == 1
        assert REGISTRY.get_sample_value("kvconductor_kv_index_snapshots_total") == snapshots + 1
    finally:
        task.cancel()
        await second.stop()
