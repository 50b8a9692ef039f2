"""kvmeta keeps every worker, against a real etcd: in-process kvmeta servers (port 0) and the worker's publisher.

* A worker holding a full emulated pool (190,464 blocks, 6.2 MiB of hashes) is back in prefix routing on
  a restarted kvmeta within one heartbeat, its inventory in 1 MiB chunks (main sent one 6.2 MiB message,
  refused with RESOURCE_EXHAUSTED forever).
* A worker that publishes before kvmeta's watch saw its record is refused, and gets in once it has.
* A worker killed with SIGKILL: when its lease expires kvmeta drops its blocks.
* A kvmeta too slow to answer gets the unanswered deltas again, never the whole inventory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cli.etcd_server import EmbeddedEtcd
from kvconductor.v1 import kvmeta_pb2, kvmeta_pb2_grpc
from scheduler.cost_model import DecodeModel, PrefillModel
from services.common.hash_batches import MESSAGE_BUDGET
from services.common.instance_record import CostModels, InstanceRecord, KVShape, WorkerRecord
from services.common.registry import Registry
from services.common.rpc import ErrorInterceptor
from services.kvmeta.kvmeta import KvMetaServicer, services
from services.worker.kv.events import KvEventPublisher

pytestmark = pytest.mark.asyncio(loop_scope="session")
REPO_ROOT = Path(__file__).resolve().parents[2]
POOL_BLOCKS = 190_464  # an emulated prefill pool of deploy/emulated.toml
TTL = 2  # lease TTL of every instance here (etcd's minimum)
HEARTBEAT_S = 2.0  # the worker's KV-event heartbeat (Worker.heartbeat_kv_events)


def worker_record(instance_id: str) -> WorkerRecord:
    return WorkerRecord(
        role="prefill", instance_id=instance_id, address="127.0.0.1:1", kv_layout=KVShape(2, 2, 16, "float32", 8192),
        cost_model=CostModels(PrefillModel(1e-3, 2e-5, 3e-9), DecodeModel(4e-3, 5e-5, 6e-8)), block_size=16,
        num_blocks=POOL_BLOCKS,
    )  # fmt: skip


class Recording(KvMetaServicer):
    """The servicer, noting the wire size of every PublishEvents it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.calls: list[tuple[int, bool]] = []  # (seq, full_inventory) of each call

    async def PublishEvents(self, request, context):  # noqa: N802
        self.sizes.append(request.ByteSize())
        self.calls.append((request.seq, request.full_inventory))
        return await super().PublishEvents(request, context)


class Slow(Recording):
    """Answers one call of each number in ``before`` / ``after`` only after ``delay_s``: before applying it (the
    caller's deadline cancels it unapplied) or after (applied, answered too late)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s, self.before, self.after = delay_s, set(), set()

    async def PublishEvents(self, request, context):  # noqa: N802
        if request.seq in self.before:
            self.before.discard(request.seq)
            self.calls.append((request.seq, request.full_inventory))
            await asyncio.sleep(self.delay_s)
        response = await super().PublishEvents(request, context)
        if request.seq in self.after:
            self.after.discard(request.seq)
            await asyncio.sleep(self.delay_s)
        return response


class KvMeta:
    """kvmeta in process, as services/kvmeta/main.py runs it: watch, serve, then register under a lease."""

    def __init__(self, etcd: EmbeddedEtcd, cluster: str, instance_id: str, servicer: Recording | None = None) -> None:
        self.registry = Registry(etcd.endpoint, cluster, ttl=TTL)
        self.instance_id = instance_id
        self.servicer = servicer or Recording()

    async def start(self, port: int = 0) -> KvMeta:
        self.servicer.follow(self.registry)
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        for s in services(self.servicer):
            s.add_to_server(s.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        record = InstanceRecord("kvmeta", self.instance_id, f"127.0.0.1:{self.port}")
        await asyncio.to_thread(self.registry.register, record)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = kvmeta_pb2_grpc.KvMetaStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await asyncio.to_thread(self.registry.close)

    async def matches(self, block_hashes: list[bytes]) -> dict[str, int]:
        reply = await self.stub.MatchPrefix(kvmeta_pb2.MatchPrefixRequest(block_hashes=block_hashes), timeout=5)
        return {m.instance_id: m.prefix_blocks for m in reply.matches}


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``condition()`` held (polled every 20 ms); fails after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def heartbeats(publisher: KvEventPublisher) -> None:
    """What a worker runs: an empty publish every heartbeat (it re-lists kvmeta and resyncs where owed)."""
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        await publisher.publish([], [], heartbeat=True)


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]


async def test_a_worker_holding_190k_blocks_is_back_in_prefix_routing_on_a_restarted_kvmeta(etcd, cluster):
    worker = Registry(etcd.endpoint, cluster, ttl=TTL)
    await asyncio.to_thread(worker.register, worker_record("prefill-0"))
    kvmeta = await KvMeta(etcd, cluster, "kvmeta-0").start()
    await until(lambda: "prefill-0" in kvmeta.servicer.registered, 5, "kvmeta saw the worker")
    publisher = KvEventPublisher(worker, "prefill-0")
    pool = _hashes(POOL_BLOCKS)
    beating = asyncio.create_task(heartbeats(publisher))
    try:
        await publisher.publish(pool, [])  # the first publish: the whole inventory
        assert kvmeta.servicer.index.num_blocks("prefill-0") == POOL_BLOCKS
        await publisher.publish([], pool[-1000:])  # deltas as usual
        assert await kvmeta.matches(pool[5000:5100]) == {"prefill-0": 100}
        await publisher.publish(pool[-1000:], [])

        await kvmeta.stop()  # kvmeta restarts on the same port: it knows nobody
        kvmeta = await KvMeta(etcd, cluster, "kvmeta-0").start(kvmeta.port)
        started = time.monotonic()
        back = await until(
            lambda: kvmeta.servicer.index.num_blocks("prefill-0") == POOL_BLOCKS, HEARTBEAT_S + TTL + 3,
            "the worker's inventory on the restarted kvmeta",
        )  # fmt: skip
        print(f"back in {back:.2f} s; PublishEvents sizes (bytes): {kvmeta.servicer.sizes}")
        assert await kvmeta.matches(pool[:64]) == {"prefill-0": 64}
        assert await kvmeta.matches(pool[-64:] + [b"\0" * 32]) == {"prefill-0": 64}
        chunked = [s for s in kvmeta.servicer.sizes if s > 1000]
        assert len(chunked) == 7 and max(chunked) <= MESSAGE_BUDGET + 64  # 1 MiB chunks; 6.2 MiB in one on main
        assert time.monotonic() - started < HEARTBEAT_S + TTL  # within one heartbeat, well within a lease TTL
        await publisher.publish([b"\1" * 32], [])  # deltas carry on from the resync's number
        assert kvmeta.servicer.index.num_blocks("prefill-0") == POOL_BLOCKS + 1
    finally:
        beating.cancel()
        await publisher.close()
        await kvmeta.stop()
        await asyncio.to_thread(worker.close)


async def test_a_worker_publishing_before_kvmeta_saw_its_record_is_refused_then_gets_in(etcd, cluster):
    kvmeta = await KvMeta(etcd, cluster, "kvmeta-0").start()
    worker = Registry(etcd.endpoint, cluster, ttl=TTL)
    publisher = KvEventPublisher(worker, "prefill-7")
    blocks = _hashes(10)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kvmeta.stub.PublishEvents(kvmeta_pb2.PublishEventsRequest(instance_id="prefill-7", seq=1))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'prefill-7' is not registered" in refused.value.details()
        await publisher.publish(blocks, [])  # the worker does not fail: it will retry with its whole inventory
        assert kvmeta.servicer.index.instances() == []
        await asyncio.to_thread(worker.register, worker_record("prefill-7"))
        await until(lambda: "prefill-7" in kvmeta.servicer.registered, 5, "kvmeta saw the record")
        await publisher.publish([], [], heartbeat=True)  # the next heartbeat gets in
        assert await kvmeta.matches(blocks) == {"prefill-7": 10}
    finally:
        await publisher.close()
        await kvmeta.stop()
        await asyncio.to_thread(worker.close)


async def test_a_killed_workers_blocks_go_when_its_lease_ends(etcd, cluster):
    script = textwrap.dedent(
        f"""
        import json, time
        from services.common.instance_record import InstanceRecord
        from services.common.registry import Registry
        registry = Registry({etcd.endpoint!r}, {cluster!r}, ttl={TTL})
        registry.register(InstanceRecord.from_json(json.loads({json.dumps(worker_record("victim").to_json())!r})))
        print("registered", flush=True)
        time.sleep(60)
        """
    )
    kvmeta = await KvMeta(etcd, cluster, "kvmeta-0").start()
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE)
    publisher = KvEventPublisher(kvmeta.registry, "victim")  # the worker's publisher (it lists kvmeta only)
    blocks = _hashes(40)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"registered"
        await until(lambda: "victim" in kvmeta.servicer.registered, 5, "kvmeta saw the worker")
        await publisher.publish(blocks[:30], [])
        await kvmeta.stub.PublishEvents(kvmeta_pb2.PublishEventsRequest(
            instance_id="victim", seq=2, stored_block_hashes=blocks[30:], full_inventory=True, num_chunks=2,
        ))  # fmt: skip
        assert await kvmeta.matches(blocks) == {"victim": 40}  # and a resync half received
        proc.kill()
        proc.wait()
        gone = await until(lambda: not kvmeta.servicer.index.instances(), TTL + 1.5, "the blocks dropped")
        print(f"dropped {gone:.2f} s after the kill")
        assert await kvmeta.matches(blocks) == {} and not kvmeta.servicer.resyncs.staged()
        await publisher.publish(blocks[:1], [], heartbeat=True)  # a zombie's events are refused, not indexed
        assert kvmeta.servicer.index.instances() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await publisher.close()
        await kvmeta.stop()


async def test_a_kvmeta_too_slow_to_answer_gets_the_unanswered_deltas_again_not_the_inventory(etcd, cluster):
    """A timed-out delta may or may not have arrived: it goes again under its number, and kvmeta takes a number
    it has applied as done. Full inventories in answer to a slow kvmeta kept sixteen workers' resyncs running
    for minutes after a burst."""
    worker = Registry(etcd.endpoint, cluster, ttl=TTL)
    await asyncio.to_thread(worker.register, worker_record("prefill-3"))
    slow = Slow(delay_s=1.0)
    kvmeta = await KvMeta(etcd, cluster, "kvmeta-0", slow).start()
    await until(lambda: "prefill-3" in slow.registered, 5, "kvmeta saw the worker")
    publisher = KvEventPublisher(worker, "prefill-3", timeout_s=0.3)
    pool = _hashes(4000)
    try:
        await publisher.publish(pool[:1000], [])  # 1: the first publish is the inventory
        slow.before.add(2)
        slow.after.add(3)
        await publisher.publish(pool[1000:2000], [])  # 2: cancelled by the deadline before kvmeta applied it
        assert slow.index.num_blocks("prefill-3") == 1000
        await publisher.publish(pool[2000:3000], [])  # 2 again, then 3: applied, its answer too late
        assert slow.index.num_blocks("prefill-3") == 3000
        await publisher.publish(pool[3000:], pool[:10])  # 3 again (in already), then 4
        assert slow.index.num_blocks("prefill-3") == 3990
        assert await kvmeta.matches(pool[10:4000]) == {"prefill-3": 3990}
        assert slow.calls == [(1, True), (2, False), (2, False), (3, False), (3, False), (4, False)]
    finally:
        await publisher.close()
        await kvmeta.stop()
        await asyncio.to_thread(worker.close)
