"""The Mooncake Store tier against a real ``mooncake_master``: blocks one worker process put, another reads.

Each side is a ``KVStore`` over a torch tensor standing in for a worker's KV pool (registered with the
Store, as the worker registers its pool), in two processes: the Store moves the bytes between them.
"""

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection

import pytest
import torch

from services.common.config import Config, StoreConfig
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent
from services.store.master import StoreMaster
from services.worker.engines.port import KVLayout
from services.worker.kv.store import KVStore

BLOCKS = 64
BLOCK_BYTES = 16 << 10


def _layout(pool: torch.Tensor) -> KVLayout:
    return KVLayout(block_size=16, num_blocks=BLOCKS, bytes_per_block=BLOCK_BYTES, base_address=pool.data_ptr(),
                    num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", max_model_len=1024,
                    vocab_size=256)  # fmt: skip


def _store(pool: torch.Tensor, record: StoreRecord, read_timeout_s: float = 1.0) -> KVStore:
    config = Config()
    config.store = StoreConfig(enabled=True, segment_mb=16, read_timeout_s=read_timeout_s)
    store = KVStore(config, _layout(pool))
    store.on_event(InstanceEvent("put", "store", record.instance_id, record))
    return store


def _wait_connected(store: KVStore, timeout_s: float = 60.0) -> None:
    """Until the store's client is connected to the master of its record (its thread connects on its own)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not store.connected:
        assert time.monotonic() < deadline, "the store client never connected"
        time.sleep(0.05)


def _record(master: StoreMaster) -> StoreRecord:
    return StoreRecord("store", "store-0", "127.0.0.1:1", master_address=master.address, generation=master.generation)


def _writer(conn: Connection, record: StoreRecord) -> None:
    """A worker that computed blocks 0..7 (each filled with its index + 1) and puts them."""
    import asyncio

    pool = torch.zeros(BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
    for b in range(8):
        pool[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES] = b + 1
    store = _store(pool, record)
    first = asyncio.run(store.put([bytes([h]) * 32 for h in range(8)], list(range(8))))
    again = asyncio.run(store.put([bytes([h]) * 32 for h in range(8)], list(range(8))))
    conn.send((first.blocks, first.bytes, first.note, again.blocks))
    conn.recv()  # stay alive (its segment holds the objects) until told to go


@pytest.fixture
def master():
    m = StoreMaster(StoreConfig(), "127.0.0.1")
    m.ensure_running()
    assert m.wait_accepting(), "mooncake_master did not come up"
    yield m
    m.stop()


def test_blocks_put_by_one_process_are_read_by_another(master):
    import asyncio

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(child, _record(master)))
    writer.start()
    try:
        assert parent.poll(60), "the writer never answered"
        blocks, nbytes, note, again = parent.recv()
        assert (blocks, nbytes, note) == (8, 8 * BLOCK_BYTES, "")
        assert again == 0  # already in the Store: nothing is put twice

        pool = torch.zeros(BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
        reader = _store(pool, _record(master))
        _wait_connected(reader)
        hashes = [bytes([h]) * 32 for h in range(8)] + [b"\xee" * 32]  # the last one was never put
        io = asyncio.run(reader.fill(hashes, [40 + i for i in range(9)]))
        assert io.blocks == 8 and io.bytes == 8 * BLOCK_BYTES and "8 of 9" in io.note
        assert io.gone  # the Store answered that the ninth is not there (kvmeta is told)
        for i in range(8):  # block i landed, byte-exact, in pool block 40 + i
            got = pool[(40 + i) * BLOCK_BYTES : (41 + i) * BLOCK_BYTES]
            assert torch.equal(got, torch.full_like(got, i + 1)), f"block {i}"
        assert int(pool[48 * BLOCK_BYTES :].sum()) == 0  # nothing beyond the run was written

        # A restarted master has lost every object; the reader reconnects to the new start and misses.
        os.kill(master.pid, signal.SIGKILL)
        master._process.wait()
        assert master.ensure_running() and master.wait_accepting()
        reader.on_event(InstanceEvent("put", "store", "store-0", _record(master)))
        _wait_connected(reader)  # the reader connects to the new start as soon as it learns of it
        assert asyncio.run(reader.fill(hashes, [40 + i for i in range(9)])).blocks == 0
        put = asyncio.run(reader.put(hashes[:2], [40, 41]))  # and takes new blocks again
        assert put.blocks == 2 and asyncio.run(reader.fill(hashes, [50 + i for i in range(9)])).blocks == 2
    finally:
        parent.send("go")
        writer.join(30)
        if writer.is_alive():
            writer.kill()


def test_a_read_the_hanging_master_does_not_answer_is_given_up_within_its_bound(master):
    import asyncio
    import time

    # Another process puts the blocks: a client that put them itself may answer a read without the master.
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(child, _record(master)))
    writer.start()

    async def scenario() -> None:
        pool = torch.zeros(BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
        store = _store(pool, _record(master), read_timeout_s=0.5)
        _wait_connected(store)
        hashes = [bytes([h]) * 32 for h in range(4)]
        os.kill(master.pid, signal.SIGSTOP)  # alive but silent: Mooncake's own call would wait 30 s
        try:
            start = time.monotonic()
            io = await store.fill(hashes, [40, 41, 42, 43])
            waited = time.monotonic() - start
            assert (io.blocks, io.note, io.gone) == (0, "no answer within 0.5 s", False), io
            assert io.pending is not None and not io.pending.done()  # the call still runs: the blocks are its
            assert waited < 10, waited  # the bound (0.5 s), far below Mooncake's 30 s; generous on a busy machine
            assert not store.available
            again = await store.fill(hashes, [44, 45, 46, 47])  # no second wait behind the hanging call
            assert (again.blocks, again.pending, again.note, again.gone) == (0, None, "store unavailable", False)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        late = await asyncio.wait_for(io.pending, 60)  # the master answers again: the call ends, blocks freed
        assert late.blocks in (0, 4), late

    try:
        assert parent.poll(60), "the writer never answered"
        assert parent.recv()[0] == 8
        asyncio.run(scenario())
    finally:
        parent.send("go")
        writer.join(30)
        if writer.is_alive():
            writer.kill()
