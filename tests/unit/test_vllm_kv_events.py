"""vLLM's KV cache events, as its ZMQ publisher encodes them, become this repository's chained block hashes."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed import kv_events

from engine.block_hash import prefix_block_hashes
from engine.block_manager import StoredBlock
from services.worker.engines.vllm_engine import KVEventTranslator
from services.worker.kv.zmq_events import ZmqKvEventPublisher

pytestmark = pytest.mark.vllm
BS = 32


def _batch(*events):
    return msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))


def _stored(hashes, parent, tokens):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


def _chain(tokens):
    """The blocks of a prompt as our engine announces them: chained hashes, each with its parent and tokens."""
    hashes = prefix_block_hashes(tokens, BS)
    return [StoredBlock(h, hashes[i - 1] if i else None, tuple(tokens[i * BS : (i + 1) * BS]))
            for i, h in enumerate(hashes)]  # fmt: skip


def test_stored_blocks_chain_from_their_parent_and_match_the_conductors_hashes():
    tokens = list(range(100, 100 + 4 * BS))
    ours = prefix_block_hashes(tokens, BS)
    t = KVEventTranslator(BS)
    t.apply_payload(_batch(_stored([b"a", b"b"], None, tokens[: 2 * BS])))
    t.apply_payload(_batch(_stored([b"c", b"d"], b"b", tokens[2 * BS :])))
    assert t.pop() == (_chain(tokens), [])
    t.apply_payload(_batch(kv_events.BlockRemoved(block_hashes=[b"d", b"unknown"], medium="GPU")))
    assert t.pop() == ([], [ours[3]])
    t.apply_payload(_batch(kv_events.AllBlocksCleared()))
    assert sorted(t.pop()[1]) == sorted(ours[:3])


def test_a_block_whose_parent_was_missed_is_not_announced():
    t = KVEventTranslator(BS)
    t.apply_payload(_batch(_stored([b"x"], b"never-seen", list(range(BS)))))
    t.apply_payload(b"\xc1 not msgpack")
    assert t.pop() == ([], [])


def test_our_zmq_events_decode_as_vllms_and_translate_back_to_the_same_blocks():
    import zmq

    tokens = list(range(7, 7 + 3 * BS))
    ours = prefix_block_hashes(tokens, BS)
    stored = _chain(tokens)
    publisher = ZmqKvEventPublisher("127.0.0.1", BS)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(publisher.endpoint)
        frames = None
        for _ in range(50):  # a PUB drops what it sends before the subscription arrives: resend until one lands
            publisher.publish(stored, [])
            try:
                frames = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        assert frames is not None, "no batch reached the subscriber"
        topic, seq, payload = frames
        assert topic == b"" and len(seq) == 8
        batch = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)  # vLLM's own decoder
        assert [type(e).__name__ for e in batch.events] == ["BlockStored"] * 3
        t = KVEventTranslator(BS)
        t.apply(batch.events)
        assert t.pop() == (stored, [])  # our translator of vLLM's events finds the same chain of blocks
        publisher.publish([], [ours[2]])
        removed = msgspec.msgpack.decode(sub.recv_multipart()[2], type=kv_events.KVEventBatch).events
        assert [(type(e).__name__, e.block_hashes) for e in removed] == [("BlockRemoved", [ours[2]])]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_blocks_a_connector_keeps_in_another_tier_are_not_credited_to_vllms_own_pool():
    tokens = list(range(300, 300 + 2 * BS))
    ours = prefix_block_hashes(tokens, BS)
    t = KVEventTranslator(BS)
    store = kv_events.BlockStored(block_hashes=[b"a", b"b"], parent_block_hash=None, token_ids=tokens, block_size=BS,
                                  lora_id=None, medium="cpu", lora_name=None)  # fmt: skip
    t.apply_payload(_batch(store))  # the Mooncake Store connector's put (or a CPU offload): not in vLLM's pool
    assert t.pop() == ([], []) and t.held_prefix(ours) == 0
    t.apply_payload(_batch(_stored([b"a", b"b"], None, tokens)))  # computed here
    assert t.held_prefix(ours) == 2
    t.apply_payload(_batch(kv_events.BlockRemoved(block_hashes=[b"b"], medium="cpu")))  # evicted from that tier only
    assert t.held_prefix(ours) == 2 and t.pop()[1] == []
    t.apply_payload(_batch(kv_events.BlockRemoved(block_hashes=[b"b"], medium="GPU")))
    assert t.held_prefix(ours) == 1 and t.pop()[1] == [ours[1]]


def _put(hashes, parent, tokens):
    """A Mooncake Store connector's put: one event per block, naming the request's previous block as parent."""
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="cpu", lora_name=None, group_idx=0)  # fmt: skip


def test_the_store_connectors_puts_become_the_stores_blocks_in_our_hashes():
    tokens = list(range(500, 500 + 3 * BS))
    ours = prefix_block_hashes(tokens, BS)
    t = KVEventTranslator(BS)
    t.apply_payload(_batch(_stored([b"a", b"b"], None, tokens[: 2 * BS])))  # the pool stored them first
    t.apply_payload(_batch(_put([b"a"], None, tokens[:BS]), _put([b"b"], b"a", tokens[BS : 2 * BS])))
    # A put whose block the pool already evicted (no token ids either): its parent is known, its tokens are not.
    t.apply_payload(_batch(_put([b"c"], b"b", [])))
    assert t.pop_store_puts() == ours[:2] and t.pop_store_puts() == []
    t.apply_payload(_batch(_put([b"c"], b"b", tokens[2 * BS :])))  # with its tokens: chained from the parent
    assert t.pop_store_puts() == [ours[2]]
    t.apply_payload(_batch(_put([b"z"], b"never-seen", tokens[:BS])))  # neither block nor parent known
    assert t.pop_store_puts() == []
    assert t.held_prefix(ours) == 2 and t.pop()[0] == _chain(tokens[: 2 * BS])  # the pool's own view is unchanged
