"""kvmeta's index of the Mooncake Store tier: entries from many workers, dropped when the master restarts or the
store service stays away."""

import asyncio

import pytest

from kvconductor.v1 import common_pb2, kvmeta_pb2
from services.common.instance_record import InstanceRecord, StoreRecord
from services.common.registry import InstanceEvent
from services.common.rpc import RpcError
from services.kvmeta.kvmeta import KvMetaServicer


def _request(instance_id, stored=(), removed=(), tier=common_pb2.KV_TIER_STORE, seq=0, full=False):
    return kvmeta_pb2.PublishEventsRequest(instance_id=instance_id, seq=seq, stored_block_hashes=list(stored),
                                           removed_block_hashes=list(removed), full_inventory=full,
                                           tier=tier)  # fmt: skip


def _publish(kvmeta, *args, **kwargs):
    return asyncio.run(kvmeta.PublishEvents(_request(*args, **kwargs), None))


def _store(generation):
    return StoreRecord("store", "store-0", "127.0.0.1:1", master_address="127.0.0.1:2", generation=generation)


def test_store_entries_come_from_many_writers_without_sequence_and_go_with_a_new_master():
    kvmeta = KvMetaServicer()
    h = [bytes([i]) * 32 for i in range(5)]
    kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(1)))
    prefill = InstanceRecord("prefill", "prefill-0", "127.0.0.1:3")  # only registered instances publish
    kvmeta.on_instance_event(InstanceEvent("put", "prefill", "prefill-0", prefill))
    assert not _publish(kvmeta, "store-0", h[:3]).resync_required  # prefill-0 put three blocks
    assert not _publish(kvmeta, "store-0", h[3:]).resync_required  # prefill-1 the other two: no sequence, no gap
    assert kvmeta.index.match_prefix(h).prefix_blocks == {"store-0": 5}
    _publish(kvmeta, "store-0", removed=[h[2]])  # a worker found block 2 gone from the Store
    assert kvmeta.index.match_prefix(h).prefix_blocks == {"store-0": 2}
    # A worker's own pool events keep their sequence beside it.
    assert _publish(kvmeta, "prefill-0", h[:1], tier=common_pb2.KV_TIER_POOL, seq=5).resync_required
    kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(1)))  # a record refresh: kept
    assert kvmeta.index.num_blocks("store-0") == 4
    kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(2)))  # the master restarted: all lost
    assert kvmeta.index.num_blocks("store-0") == 0


def test_a_lapsed_store_lease_keeps_the_index_for_the_same_master_and_not_for_a_new_one():
    h = [bytes([i]) * 32 for i in range(3)]

    async def scenario():
        kvmeta = KvMetaServicer(store_grace_s=0.3)
        kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(7)))
        await kvmeta.PublishEvents(_request("store-0", h), None)
        kvmeta.on_instance_event(InstanceEvent("delete", "store", "store-0", None))  # its etcd lease lapsed
        assert kvmeta.index.num_blocks("store-0") == 3  # the master still holds them
        with pytest.raises(RpcError):  # ... but nothing is indexed for it while it is away
            await kvmeta.PublishEvents(_request("store-0", h[:1]), None)
        kvmeta.on_instance_event(InstanceEvent("delete", "store", "store-0", None))  # a repeated delete
        kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(7)))  # back, same master
        await asyncio.sleep(0.5)  # past the grace: kept
        assert kvmeta.index.num_blocks("store-0") == 3

        kvmeta.on_instance_event(InstanceEvent("delete", "store", "store-0", None))
        kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(8)))  # back with a new master
        assert kvmeta.index.num_blocks("store-0") == 0

        await kvmeta.PublishEvents(_request("store-0", h), None)
        kvmeta.on_instance_event(InstanceEvent("delete", "store", "store-0", None))  # gone for good
        assert kvmeta.index.num_blocks("store-0") == 3
        await asyncio.sleep(0.5)
        assert kvmeta.index.num_blocks("store-0") == 0
        kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(8)))  # a late return: nothing stale
        assert kvmeta.index.num_blocks("store-0") == 0

    asyncio.run(scenario())


def test_without_a_grace_the_store_index_goes_with_its_registration():
    async def scenario():
        kvmeta = KvMetaServicer(store_grace_s=0)
        kvmeta.on_instance_event(InstanceEvent("put", "store", "store-0", _store(1)))
        await kvmeta.PublishEvents(_request("store-0", [b"\1" * 32]), None)
        kvmeta.on_instance_event(InstanceEvent("delete", "store", "store-0", None))
        assert kvmeta.index.num_blocks("store-0") == 0

    asyncio.run(scenario())


def test_store_record_round_trips_through_its_json():
    record = _store(3)
    assert InstanceRecord.from_json(record.to_json()) == record
