"""KV block transfers between two processes over the Mooncake Transfer Engine (TCP, loopback)."""

import multiprocessing
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from services.worker.kv.transfer import (
    MAX_ENTRIES,
    POLL_S,
    RETRY_BACKOFF_S,
    KVTransferEngine,
    TransferError,
    coalesce,
)

POOL_BYTES = 4 << 20
BLOCK = 64 << 10


def _peer_main(conn: Connection) -> None:
    """The remote instance: a registered pool it can fill and dump on request."""
    engine = KVTransferEngine()
    pool = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    engine.register(pool.data_ptr(), POOL_BYTES)
    conn.send((engine.endpoint, pool.data_ptr()))
    while True:
        command, arg = conn.recv()
        if command == "dump":
            conn.send(pool.numpy().tobytes())
        elif command == "fill":
            pool.copy_(torch.frombuffer(bytearray(arg), dtype=torch.uint8))
            conn.send(None)
        else:
            return


class Peer:
    def __init__(self, conn: Connection, endpoint: str, base: int) -> None:
        self.conn = conn
        self.endpoint = endpoint
        self.base = base

    def dump(self) -> torch.Tensor:
        self.conn.send(("dump", None))
        return torch.frombuffer(bytearray(self.conn.recv()), dtype=torch.uint8)

    def fill(self, data: torch.Tensor) -> None:
        self.conn.send(("fill", data.numpy().tobytes()))
        self.conn.recv()

    def addr(self, block: int) -> int:
        return self.base + block * BLOCK


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc: Any = ctx.Process(target=_peer_main, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("peer process did not start")
        endpoint, base = parent.recv()
        yield Peer(parent, endpoint, base)
        parent.send(("stop", None))
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.fixture(scope="module")
def local() -> tuple[KVTransferEngine, torch.Tensor]:
    engine = KVTransferEngine()
    pool = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    engine.register(pool.data_ptr(), POOL_BYTES)
    return engine, pool


def random_pool(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def blocks_of(pool: torch.Tensor, ids: list[int]) -> list[int]:
    return [pool.data_ptr() + i * BLOCK for i in ids]


# Two contiguous runs on both sides, one block contiguous on one side only, one reversed pair.
SRC_IDS = [0, 1, 2, 10, 11, 20, 31, 30]
DST_IDS = [40, 41, 42, 5, 7, 8, 50, 49]


def test_coalesce_merges_runs_contiguous_on_both_sides() -> None:
    srcs, dsts, lengths = coalesce([0, 10, 20, 50, 60], [100, 110, 120, 130, 140], 10)
    assert (srcs, dsts, lengths) == ([0, 50], [100, 130], [30, 20])
    assert coalesce([0, 20, 10], [0, 10, 20], 10) == ([0, 20, 10], [0, 10, 20], [10, 10, 10])


@pytest.mark.parametrize("merge", [True, False])
def test_write_blocks_land_exactly(peer: Peer, local: tuple[KVTransferEngine, torch.Tensor], merge: bool) -> None:
    engine, pool = local
    engine.merge = merge
    pool.copy_(random_pool(1))
    peer.fill(torch.zeros(POOL_BYTES, dtype=torch.uint8))
    before = engine.counts()

    result = engine.write_blocks(peer.endpoint, blocks_of(pool, SRC_IDS), [peer.addr(i) for i in DST_IDS], BLOCK)

    expected = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        expected[d * BLOCK : (d + 1) * BLOCK] = pool[s * BLOCK : (s + 1) * BLOCK]
    assert torch.equal(peer.dump(), expected)
    assert (result.bytes, result.blocks) == (len(SRC_IDS) * BLOCK, len(SRC_IDS))
    assert result.seconds > 0
    assert engine.counts().bytes_written - before.bytes_written == result.bytes
    assert engine.counts().blocks_written - before.blocks_written == len(SRC_IDS)


def test_read_blocks_pull_exactly(peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]) -> None:
    engine, pool = local
    remote = random_pool(2)
    peer.fill(remote)
    pool.zero_()
    read_before = engine.counts().bytes_read

    result = engine.read_blocks(peer.endpoint, blocks_of(pool, DST_IDS), [peer.addr(i) for i in SRC_IDS], BLOCK)

    expected = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        expected[d * BLOCK : (d + 1) * BLOCK] = remote[s * BLOCK : (s + 1) * BLOCK]
    assert torch.equal(pool, expected)
    assert engine.counts().bytes_read - read_before == result.bytes == len(SRC_IDS) * BLOCK
    assert engine.counts().blocks_read == len(SRC_IDS)


def test_bad_arguments_are_refused(peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]) -> None:
    engine, pool = local
    with pytest.raises(ValueError, match="local addresses"):
        engine.write_blocks(peer.endpoint, [pool.data_ptr()], [], BLOCK)
    with pytest.raises(ValueError, match="protocol"):
        KVTransferEngine(protocol="udp")


def test_a_modeled_link_makes_a_transfer_take_the_modeled_time(
    peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]
) -> None:
    engine, pool = local
    pool.copy_(random_pool(3))
    engine.link_floor = lambda num_bytes: 0.2 + num_bytes / 1e9  # an emulated link far slower than loopback
    try:
        result = engine.write_blocks(peer.endpoint, blocks_of(pool, [0, 1]), [peer.addr(0), peer.addr(1)], BLOCK)
    finally:
        engine.link_floor = None
    assert result.seconds >= 0.2 + 2 * BLOCK / 1e9
    assert torch.equal(peer.dump()[: 2 * BLOCK], pool[: 2 * BLOCK])  # the real bytes moved too


def test_unknown_peer_raises(local: tuple[KVTransferEngine, torch.Tensor]) -> None:
    engine, pool = local
    with pytest.raises(TransferError):
        engine.write_blocks("127.0.0.1:1", [pool.data_ptr()], [pool.data_ptr()], BLOCK)


def test_write_outside_peer_registration_is_rejected(peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]) -> None:
    engine, pool = local
    with pytest.raises(TransferError, match="returned"):
        engine.write_blocks(peer.endpoint, [pool.data_ptr()], [peer.base + POOL_BYTES - 4096], 2 * 4096)


class _Engine:
    """The Mooncake engine as the transfer calls use it, for doubles to override parts of."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def batch_transfer_async_write(self, *args: Any) -> int:
        return self.engine.batch_transfer_async_write(*args)

    def transfer_check_status(self, batch_id: int) -> int:
        return self.engine.transfer_check_status(batch_id)


class _Refusing(_Engine):
    """Refusing the first ``refusals`` writes as the engine's TCP lanes do when their queues fill."""

    def __init__(self, engine: Any, refusals: int) -> None:
        super().__init__(engine)
        self.refusals = refusals

    def batch_transfer_async_write(self, *args: Any) -> int:
        if self.refusals:
            self.refusals -= 1
            return 0
        return self.engine.batch_transfer_async_write(*args)


def test_a_refused_write_is_tried_again_and_lands(peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]) -> None:
    engine, pool = local
    real = engine._engine
    pool.copy_(random_pool(3))
    peer.fill(torch.zeros(POOL_BYTES, dtype=torch.uint8))
    before = engine.counts().retries
    try:
        engine._engine = _Refusing(real, refusals=2)
        engine.write_blocks(peer.endpoint, blocks_of(pool, [0, 1]), [peer.addr(60), peer.addr(61)], BLOCK)
        assert torch.equal(peer.dump()[60 * BLOCK : 62 * BLOCK], pool[: 2 * BLOCK])
        assert engine.counts().retries - before == 2
        engine._engine = _Refusing(real, refusals=len(RETRY_BACKOFF_S) + 1)  # refused every time: it fails
        with pytest.raises(TransferError, match=f"returned -1 \\({len(RETRY_BACKOFF_S) + 1} tries\\)"):
            engine.write_blocks(peer.endpoint, blocks_of(pool, [0]), [peer.addr(60)], BLOCK)
    finally:
        engine._engine = real


class _Counting(_Engine):
    """Counting the entries in flight at once (the most of them), and the status checks."""

    def __init__(self, engine: Any, delay_s: float = 0.0) -> None:
        super().__init__(engine)
        self.delay_s = delay_s  # each entry reads as in flight this long at least
        self.submitted: dict[int, float] = {}
        self.most_in_flight = self.checks = 0

    def batch_transfer_async_write(self, *args: Any) -> int:
        batch_id = self.engine.batch_transfer_async_write(*args)
        self.submitted[batch_id] = time.monotonic()
        self.most_in_flight = max(self.most_in_flight, len(self.submitted))
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        self.checks += 1
        if time.monotonic() - self.submitted[batch_id] < self.delay_s:
            return 0
        status = self.engine.transfer_check_status(batch_id)
        if status:
            del self.submitted[batch_id]
        return status


def test_a_write_of_scattered_blocks_goes_in_batches_and_lands(
    peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]
) -> None:
    """A prompt written into a fragmented pool: one entry per block, never all of them in one engine call."""
    engine, pool = local
    real, small = engine._engine, 1024
    pool.copy_(random_pool(4))
    peer.fill(torch.zeros(POOL_BYTES, dtype=torch.uint8))
    n = 3 * MAX_ENTRIES + 5
    src = [2 * i * small for i in range(n)]  # every other 1 KiB block: nothing coalesces
    dst = [(2 * i + 1) * small for i in range(n)]
    try:
        engine._engine = counting = _Counting(real)
        result = engine.write_blocks(peer.endpoint, [pool.data_ptr() + a for a in src], [peer.base + a for a in dst],
                                     small)  # fmt: skip
    finally:
        engine._engine = real
    assert counting.most_in_flight == MAX_ENTRIES and not counting.submitted
    landed = peer.dump()
    assert all(torch.equal(landed[d : d + small], pool[s : s + small]) for s, d in zip(src, dst, strict=True))
    assert result.blocks == n


def test_a_transfer_in_flight_is_waited_for_without_spinning(
    peer: Peer, local: tuple[KVTransferEngine, torch.Tensor]
) -> None:
    """Mooncake's synchronous calls poll a transfer's status in a loop that never sleeps; ours sleep between checks."""
    engine, pool = local
    real = engine._engine
    pool.copy_(random_pool(5))
    peer.fill(torch.zeros(POOL_BYTES, dtype=torch.uint8))
    try:
        engine._engine = counting = _Counting(real, delay_s=0.2)
        result = engine.write_blocks(peer.endpoint, blocks_of(pool, [0, 2]), [peer.addr(3), peer.addr(5)], BLOCK)
    finally:
        engine._engine = real
    assert result.seconds >= 0.2
    assert counting.checks <= 2 * (2 + 0.2 / POLL_S[1] + 10)  # two entries; a spinning wait checks thousands of times
    landed = peer.dump()
    assert torch.equal(landed[3 * BLOCK : 4 * BLOCK], pool[:BLOCK])
    assert torch.equal(landed[5 * BLOCK : 6 * BLOCK], pool[2 * BLOCK : 3 * BLOCK])
