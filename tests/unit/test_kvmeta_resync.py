"""kvmeta keeps every worker: chunked full inventories under the message limit, registered instances only.

The servicer is called directly (no server): a worker's pool of 190,464 blocks (deploy/emulated.toml) is
6.2 MiB in one message, over gRPC's 4 MiB limit, so it goes in 1 MiB chunks that only ever grow the
instance's entries until the last one makes them exact; an instance kvmeta has not seen registered is
refused; one whose registration goes leaves nothing behind.
"""

import asyncio
import hashlib

import grpc
import pytest

from kvconductor.v1 import common_pb2, kvmeta_pb2
from services.common.hash_batches import MESSAGE_BUDGET, chunks, entry_bytes
from services.common.instance_record import InstanceRecord
from services.common.registry import InstanceEvent
from services.common.rpc import RpcError
from services.kvmeta.kvmeta import KvMetaServicer

GRPC_LIMIT = 4 * 1024 * 1024  # gRPC's default max receive message size
POOL_BLOCKS = 190_464  # an emulated prefill pool of deploy/emulated.toml


def _hashes(n, salt=b""):
    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def _request(instance, seq, stored=(), removed=(), full=False, index=0, count=0, tier=common_pb2.KV_TIER_POOL):
    return kvmeta_pb2.PublishEventsRequest(instance_id=instance, seq=seq, stored_block_hashes=list(stored),
                                           removed_block_hashes=list(removed), full_inventory=full,
                                           chunk_index=index, num_chunks=count, tier=tier)  # fmt: skip


def _publish(kvmeta, request):
    return asyncio.run(kvmeta.PublishEvents(request, None))


def _registered(*instances):
    kvmeta = KvMetaServicer()
    for instance in instances:
        kvmeta.on_instance_event(InstanceEvent("put", "prefill", instance, InstanceRecord("prefill", instance, "x:1")))
    return kvmeta


def test_a_full_pool_is_over_the_grpc_limit_in_one_message_and_well_under_it_in_chunks():
    hashes = sorted(_hashes(POOL_BLOCKS))
    assert entry_bytes(hashes[0]) == 34  # tag, length, 32 bytes
    whole = _request("prefill-0", 7, hashes, full=True)
    assert whole.ByteSize() > GRPC_LIMIT  # 6,475,792 bytes (6.2 MiB): what main sent, and kvmeta refused
    parts = chunks(hashes)
    sizes = [_request("prefill-0", 7, part, full=True, index=i, count=len(parts)).ByteSize()
             for i, part in enumerate(parts)]  # fmt: skip
    assert len(parts) == 7 and [len(p) for p in parts[:-1]] == [MESSAGE_BUDGET // 34] * 6
    assert max(sizes) <= MESSAGE_BUDGET + 64 < GRPC_LIMIT // 3  # 1,048,580 bytes: a quarter of the limit
    assert [h for part in parts for h in part] == hashes  # in order, nothing lost or repeated
    assert chunks([]) == [[]]  # an empty inventory is still one message


def test_chunks_only_grow_the_entries_until_the_last_makes_them_exact():
    kvmeta = _registered("prefill-0")
    h = _hashes(10)
    assert not _publish(kvmeta, _request("prefill-0", 1, h[:4], full=True)).resync_required  # one message, as before
    new = [h[2], h[3], h[5], h[6], h[7]]  # blocks 0 and 1 were evicted meanwhile (their delta was lost)
    parts = chunks(new, budget=2 * 34)
    assert len(parts) == 3
    for i, part in enumerate(parts[:-1]):
        assert not _publish(kvmeta, _request("prefill-0", 9, part, full=True, index=i, count=3)).resync_required
        assert set(h[:4]) <= set(kvmeta.index.blocks("prefill-0"))  # never less than before the resync
    assert kvmeta.index.match_prefix(h[:4]).prefix_blocks == {"prefill-0": 4}  # the old entries still answer
    assert kvmeta.resyncs.staged() == ["prefill-0"]
    _publish(kvmeta, _request("prefill-0", 9, parts[-1], full=True, index=2, count=3))
    assert set(kvmeta.index.blocks("prefill-0")) == set(new) and not kvmeta.resyncs.staged()
    assert kvmeta.index.match_prefix(h[2:4] + h[5:8]).prefix_blocks == {"prefill-0": 5}
    assert not _publish(kvmeta, _request("prefill-0", 10, [h[8]])).resync_required  # the resync's seq is the base


def test_a_chunk_that_does_not_continue_the_staged_resync_asks_for_the_inventory_again():
    kvmeta = _registered("prefill-0")
    h = _hashes(6)
    _publish(kvmeta, _request("prefill-0", 1, h[:2], full=True))
    # kvmeta restarted after chunk 0 (nothing staged), or a chunk was lost: start over, entries unharmed.
    assert _publish(kvmeta, _request("prefill-0", 5, h[2:4], full=True, index=1, count=3)).resync_required
    _publish(kvmeta, _request("prefill-0", 6, h[2:3], full=True, index=0, count=3))
    assert _publish(kvmeta, _request("prefill-0", 6, h[4:5], full=True, index=2, count=3)).resync_required
    assert not kvmeta.resyncs.staged() and set(h[:2]) <= set(kvmeta.index.blocks("prefill-0"))
    # A delta in the middle of a resync abandons it (and finds the resync's seq never became the base).
    _publish(kvmeta, _request("prefill-0", 7, h[2:3], full=True, index=0, count=2))
    assert _publish(kvmeta, _request("prefill-0", 8, [h[5]])).resync_required
    assert not kvmeta.resyncs.staged()
    with pytest.raises(ValueError, match="chunk_index 3 is not below num_chunks 2"):
        _publish(kvmeta, _request("prefill-0", 9, full=True, index=3, count=2))


@pytest.mark.parametrize("tier", [common_pb2.KV_TIER_POOL, common_pb2.KV_TIER_STORE])
def test_an_instance_kvmeta_has_not_seen_registered_is_refused_by_name(tier):
    kvmeta = _registered("prefill-0")
    with pytest.raises(RpcError) as refused:
        _publish(kvmeta, _request("prefill-9", 1, _hashes(3), full=True, tier=tier))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'prefill-9' is not registered" in refused.value.message
    assert kvmeta.index.instances() == []  # nothing entered that no lease would take out


def test_a_departed_instance_leaves_nothing_behind_and_cannot_come_back_unregistered():
    kvmeta = _registered("prefill-0", "prefill-1")
    h = _hashes(8)
    _publish(kvmeta, _request("prefill-0", 1, h[:4], full=True))
    _publish(kvmeta, _request("prefill-1", 1, h[:2], full=True))
    _publish(kvmeta, _request("prefill-0", 2, h[4:6], full=True, index=0, count=2))  # a resync half received
    kvmeta.on_instance_event(InstanceEvent("delete", "prefill", "prefill-0", None))  # its lease ended
    assert kvmeta.index.instances() == ["prefill-1"] and not kvmeta.resyncs.staged()
    assert kvmeta.index.match_prefix(h[:4]).prefix_blocks == {"prefill-1": 2}
    with pytest.raises(RpcError, match="prefill-0"):  # still running behind a partition: refused, not re-indexed
        _publish(kvmeta, _request("prefill-0", 3, h[6:]))
    assert kvmeta.index.num_blocks("prefill-0") == 0
