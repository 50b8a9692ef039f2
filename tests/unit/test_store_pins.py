"""Write-through to the Mooncake Store: what a put caught by a hanging master may keep pinned."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.worker.engines.port import KVLayout
from services.worker.kv.store import StoreIO
from services.worker.prefill import STORE_PIN_SHARE, PrefillServicer

pytestmark = pytest.mark.asyncio(loop_scope="session")
BLOCK = 16


class PinningEngine:
    """Every block of a prompt is cached; pins are counted."""

    def __init__(self, num_blocks: int) -> None:
        self.layout = KVLayout(
            block_size=BLOCK, num_blocks=num_blocks, bytes_per_block=1024, base_address=1 << 20, num_layers=1,
            num_kv_heads=1, head_dim=8, dtype="float32", max_model_len=4096, vocab_size=256,
        )  # fmt: skip
        self.pinned = self.most_pinned = 0

    async def pin_cached_blocks(self, block_hashes, token_ids):
        assert len(token_ids) == len(block_hashes) * BLOCK
        self.pinned += len(block_hashes)
        self.most_pinned = max(self.most_pinned, self.pinned)
        return list(range(len(block_hashes)))

    async def unpin_blocks(self, block_ids):
        self.pinned -= len(block_ids)


class HangingStore:
    """A store whose puts wait until ``release`` is set, as behind a master that hangs."""

    available, store_id = True, "store-0"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.puts: list[int] = []

    async def put(self, block_hashes, block_ids):
        self.puts.append(len(block_hashes))
        await self.release.wait()
        return StoreIO()


async def test_write_throughs_in_flight_pin_at_most_their_share_of_the_pool():
    """A 56-block prompt on a 64-block pool (the CI case that starved it) goes to the Store in pieces of 16:
    while the master hangs on the first piece, 16 blocks stay pinned and a second prompt pins none."""
    engine, store = PinningEngine(num_blocks=64), HangingStore()
    events = SimpleNamespace(publish_store=lambda *args: asyncio.sleep(0))
    servicer = PrefillServicer(SimpleNamespace(engine=engine, store=store, events=events))
    cap = int(64 * STORE_PIN_SHARE)
    first = asyncio.create_task(servicer._write_through(list(range(56 * BLOCK + 5))))
    while not store.puts:  # the first piece's put has begun and hangs
        await asyncio.sleep(0.001)
    await servicer._write_through(list(range(1000, 1000 + 4 * BLOCK)))  # no pins left: skipped, not queued
    assert (engine.pinned, store.puts) == (cap, [cap])
    store.release.set()
    await first
    assert store.puts == [16, 16, 16, 8] and engine.most_pinned == cap
    assert engine.pinned == 0 and servicer.store_pins == 0
    await servicer._write_through(list(range(1000, 1000 + 4 * BLOCK)))  # pins free again: it goes through
    assert store.puts[-1] == 4
