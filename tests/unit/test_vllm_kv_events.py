"""vLLM's KV cache events, as its ZMQ publisher encodes them, become this repository's chained block hashes."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed import kv_events

from engine.block_hash import prefix_block_hashes
from services.worker.vllm_engine import KVEventTranslator

pytestmark = pytest.mark.vllm
BS = 32


def _batch(*events):
    return msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))


def _stored(hashes, parent, tokens):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


def test_stored_blocks_chain_from_their_parent_and_match_the_conductors_hashes():
    tokens = list(range(100, 100 + 4 * BS))
    ours = prefix_block_hashes(tokens, BS)
    t = KVEventTranslator(BS)
    t.apply_payload(_batch(_stored([b"a", b"b"], None, tokens[: 2 * BS])))
    t.apply_payload(_batch(_stored([b"c", b"d"], b"b", tokens[2 * BS :])))
    assert t.pop() == (ours, [])
    t.apply_payload(_batch(kv_events.BlockRemoved(block_hashes=[b"d", b"unknown"], medium="GPU")))
    assert t.pop() == ([], [ours[3]])
    t.apply_payload(_batch(kv_events.AllBlocksCleared()))
    assert sorted(t.pop()[1]) == sorted(ours[:3])


def test_a_block_whose_parent_was_missed_is_not_announced():
    t = KVEventTranslator(BS)
    t.apply_payload(_batch(_stored([b"x"], b"never-seen", list(range(BS)))))
    t.apply_payload(b"\xc1 not msgpack")
    assert t.pop() == ([], [])
