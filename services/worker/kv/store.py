"""The Mooncake Store as a worker's second KV tier: prompt blocks out, missing prefix blocks in.

A prefill (or colocated) worker of a cluster with a store service (``[store] enabled``, ``services/store``)
connects a store client (``mooncake.store.MooncakeDistributedStore``) to the master named in the service's
etcd record, contributes ``[store] segment_mb`` of its DRAM to the pool, and registers its KV pool tensor
with it, so blocks move between the engine pool and the Store without an intermediate copy:

- **write-through**: after a prefill, the prompt's full blocks that the Store lacks are put
  (``batch_put_from``), keyed by cluster, KV layout and chained block hash. Write-through rather than
  write-on-eviction: a block is in the Store from the moment any worker computed it, so every other
  prefill node can read it at once, and nothing is lost when the worker that computed it is killed before
  it would have evicted the block. The cost is one put per new block, off the request's path; none for a
  block already there (``batch_is_exist`` first: objects are immutable, a second put keeps the first).
- **fill**: the leading run of a prompt's blocks that the worker lacks is read into pool blocks allocated
  for them (``batch_get_into``); it stops at the first block the Store no longer has.

The Store is a lossy cache: a restarted master has lost every object (its record's ``generation`` changes
and the client reconnects), a crashed owner's segment reads as missing, the master evicts under
pressure, a block kvmeta lists may be gone by the time it is read. A failed or missing read only shrinks
what is reused, a failed put only leaves the block out. Calls run one at a time on the store's own
thread, never on the serving loop nor the loop's shared thread pool. Mooncake's own bounds are long
(about 4 s for a call while the master is down, 30 s while it hangs), so a fill waits at most
``[store] read_timeout_s`` for its answer: then the prompt is recomputed, the blocks the read still writes
into are given back when it ends, and the Store counts as unavailable while that call hangs (no new
put pins blocks behind it). For ``RETRY_AFTER_S`` after a failed call the worker does not try again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.config import Config
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent, Registry
from services.worker.engines.port import KVLayout
from services.worker.kv.bind_guard import ExposedListenerError, confined

log = logging.getLogger(__name__)

LOCAL_BUFFER_BYTES = 16 << 20  # the client's own staging buffer (zero-copy calls do not use it)
RETRY_AFTER_S = 5.0  # after a failed connect or call, the Store is left alone this long
KNOWN_KEYS = 1 << 16  # keys this worker put or saw in the Store, remembered to skip asking again
RPC_FAILED = (-900, -901)  # Mooncake's RPC_FAIL and RPC_TIMEOUT: the master is unreachable or hangs


@dataclass
class StoreIO:
    """What one put or fill moved."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    note: str = ""
    stored: list[builtins.bytes] = field(default_factory=list)  # a put's blocks now known in the Store (put or found)
    pending: asyncio.Future[StoreIO] | None = None  # a fill not answered in time: the call still running
    gone: bool = False  # a fill's answer: the block after the ones read is not in the Store (evicted, owner lost)


Call = Callable[[Any], "StoreIO"]  # runs on the store thread with the connected client


class KVStore:
    """The worker's store client; connects lazily to the master its cluster's store service names."""

    def __init__(self, config: Config, layout: KVLayout, link_floor: Callable[[int], float] | None = None) -> None:
        self.config = config
        self.layout = layout
        self.link_floor = link_floor  # least seconds moving n bytes takes (an emulated engine's modeled link)
        self._prefix = f"{config.cluster.name}/{layout.dtype}/{layout.bytes_per_block}/"
        self._record: StoreRecord | None = None
        self._client: Any = None  # mooncake.store.MooncakeDistributedStore (untyped); used on the store thread only
        self._connected_to: tuple[str, int] | None = None  # (master address, generation) of the client
        self._known: OrderedDict[str, None] = OrderedDict()  # store thread only
        self._quiet_until = 0.0
        self._calls: queue.SimpleQueue[tuple[Call, asyncio.AbstractEventLoop | None, asyncio.Future[StoreIO] | None]]
        self._calls = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # calls come from the serving loop and the registry's watch thread
        self._busy_since: float | None = None  # when the call running now started

    def follow(self, registry: Registry) -> None:
        """Track the store service's record in ``registry`` (its master, and each restart of it)."""
        registry.watch(self.on_event, roles=["store"])
        for record in registry.list("store").values():
            self.on_event(InstanceEvent("put", "store", record.instance_id, record))

    def on_event(self, event: InstanceEvent) -> None:
        """A store service registered, changed (a new master start) or left."""
        if event.kind == "put" and isinstance(event.record, StoreRecord):
            old, self._record = self._record, event.record
            if old is None or old.generation != event.record.generation:
                self._quiet_until = 0.0  # a new master: worth trying at once, whatever failed against the old one
                self._enqueue(lambda client: StoreIO(), None, None)  # connect now, not on a request's read
        elif event.kind == "delete":
            self._record = None

    @property
    def store_id(self) -> str:
        """The store service's instance id (the Store's holder name in kvmeta), "" when none is registered."""
        record = self._record
        return record.instance_id if record is not None else ""

    @property
    def available(self) -> bool:
        """Whether a store service is registered, the Store was not failing just now and no call hangs."""
        now, busy = time.monotonic(), self._busy_since
        hangs = busy is not None and now - busy > self.config.store.read_timeout_s
        return self._record is not None and now >= self._quiet_until and not hangs

    @property
    def connected(self) -> bool:
        """Whether the client is connected to the master of the current record (reads go only to one)."""
        record = self._record
        return record is not None and self._connected_to == (record.master_address, record.generation)

    def key(self, block_hash: bytes) -> str:
        """The Store key of a block of this cluster's KV layout."""
        return self._prefix + block_hash.hex()

    async def put(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> StoreIO:
        """Put the blocks the Store lacks (their memory must stay valid until this returns)."""
        hashes, ids = list(block_hashes), list(block_ids)
        return await self._modeled(await self._submit(lambda client: self._put(client, hashes, ids)))

    async def fill(self, block_hashes: Sequence[bytes], targets: Sequence[int]) -> StoreIO:
        """Read the leading run of ``block_hashes`` the Store holds into pool blocks ``targets``.

        Without an answer within ``[store] read_timeout_s`` it returns with no block read and ``pending``
        set: the read still writes into ``targets`` until ``pending`` resolves.
        """
        if not (self.available and self.connected):  # a read would wait behind a hanging call or a connect
            return StoreIO(note="store unavailable")
        hashes, ids = list(block_hashes), list(targets)
        call = self._submit(lambda client: self._fill(client, hashes, ids))
        timeout = self.config.store.read_timeout_s
        done, _ = await asyncio.wait({call}, timeout=timeout)
        if not done:
            self._back_off(f"a read got no answer within {timeout:.1f} s", reconnect=False)
            return StoreIO(note=f"no answer within {timeout:.1f} s", pending=call)
        return await self._modeled(call.result())

    def _submit(self, call: Call) -> asyncio.Future[StoreIO]:
        """Queue ``call`` for the store thread (started on first use); resolves with its StoreIO."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StoreIO] = loop.create_future()
        self._enqueue(call, loop, future)
        return future

    def _enqueue(
        self, call: Call, loop: asyncio.AbstractEventLoop | None, future: asyncio.Future[StoreIO] | None
    ) -> None:
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="mooncake-store", daemon=True)
                self._thread.start()
        self._calls.put((call, loop, future))

    def _serve(self) -> None:
        """The store thread: one call at a time (the client is not documented thread-safe)."""
        while True:
            call, loop, future = self._calls.get()
            self._busy_since = time.monotonic()
            try:
                client = self._connect()
                io = call(client) if client is not None else StoreIO(note="store unavailable")
            except Exception as e:  # noqa: BLE001 - a broken client call only costs the reuse
                log.warning("Mooncake Store call failed: %r", e)
                io = StoreIO(note=f"store call failed: {e!r}")
            finally:
                self._busy_since = None
            if loop is not None and future is not None:
                with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for the answer
                    loop.call_soon_threadsafe(_resolve, future, io)

    async def _modeled(self, io: StoreIO) -> StoreIO:
        """On a modeled link, wait the rest of the time ``io``'s bytes take there."""
        if self.link_floor is not None and io.bytes:
            floor = self.link_floor(io.bytes)
            await asyncio.sleep(max(0.0, floor - io.seconds))
            io.seconds = max(io.seconds, floor)
        return io

    def _put(self, client: Any, hashes: list[bytes], block_ids: list[int]) -> StoreIO:
        fresh = [(h, b) for h, b in zip(hashes, block_ids, strict=True) if self.key(h) not in self._known]
        if not fresh:
            return StoreIO()
        start = time.perf_counter()
        present = client.batch_is_exist([self.key(h) for h, _ in fresh])
        todo = [(h, b) for (h, b), p in zip(fresh, present, strict=True) if p != 1]
        size = self.layout.bytes_per_block
        addresses = [self.layout.block_address(b) for _, b in todo]
        codes = client.batch_put_from([self.key(h) for h, _ in todo], addresses, [size] * len(todo)) if todo else []
        failed = {h for (h, _), code in zip(todo, codes, strict=True) if code != 0}
        if any(code in RPC_FAILED for code in codes):
            self._back_off("a put failed: the master is unreachable")
        stored = [h for h, _ in fresh if h not in failed]
        for h in stored:
            self._remember(self.key(h))
        put = len(todo) - len(failed)
        note = f"{len(failed)} puts failed ({min(codes)})" if failed else ""
        return StoreIO(put, put * size, time.perf_counter() - start, note, stored)

    def _fill(self, client: Any, hashes: list[bytes], targets: list[int]) -> StoreIO:
        keys = [self.key(h) for h in hashes[: len(targets)]]
        if not keys:
            return StoreIO()
        start = time.perf_counter()
        size = self.layout.bytes_per_block
        results = client.batch_get_into(keys, [self.layout.block_address(b) for b in targets[: len(keys)]],
                                        [size] * len(keys))  # fmt: skip
        n = 0
        while n < len(results) and results[n] == size:
            n += 1
        note = "" if n == len(keys) else f"the Store had {n} of {len(keys)} blocks ({results[n]})"
        for k in keys[n:]:  # gone (evicted, or lost with its owner): put again by the next prefill of it
            self._known.pop(k, None)
        unreachable = n < len(results) and results[n] in RPC_FAILED
        if unreachable:
            self._back_off("a read failed: the master is unreachable")
        return StoreIO(n, n * size, time.perf_counter() - start, note, gone=n < len(keys) and not unreachable)

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _back_off(self, why: str, reconnect: bool = True) -> None:
        """Leave the Store alone for RETRY_AFTER_S (and, with ``reconnect``, from the store thread: drop the client)."""
        log.warning("Mooncake Store: %s; leaving it alone for %.0f s", why, RETRY_AFTER_S)
        self._quiet_until = time.monotonic() + RETRY_AFTER_S
        if reconnect:
            self._retire()
            self._known.clear()

    def _retire(self) -> None:
        """Store thread: drop the client (closed on a thread of its own)."""
        client, self._client, self._connected_to = self._client, None, None
        if client is not None:
            _close_later(client)

    def _connect(self) -> Any:
        """Store thread: the client for the current master (reconnecting after its restart), or None."""
        record = self._record
        if record is None or time.monotonic() < self._quiet_until:
            return None
        target = (record.master_address, record.generation)
        if self._client is not None and self._connected_to == target:
            return self._client
        self._retire()  # a client of a master that is gone
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        segment = self.config.store.segment_mb << 20
        try:
            with confined(self.config.cluster.host):  # the client's own Transfer Engine listens on the host only
                code = client.setup(self.config.cluster.host, "P2PHANDSHAKE", segment, LOCAL_BUFFER_BYTES, "tcp",
                                    "", record.master_address)  # fmt: skip
        except ExposedListenerError as e:
            _close_later(client)
            self._back_off(str(e), reconnect=False)
            return None
        if code == 0:
            code = client.register_buffer(self.layout.base_address, self.layout.nbytes)
        if code != 0:
            _close_later(client)
            self._back_off(f"cannot connect to the master at {record.master_address} ({code})")
            return None
        log.info("Mooncake Store: connected to %s (generation %d), %d MiB contributed", record.master_address,
                 record.generation, self.config.store.segment_mb)  # fmt: skip
        self._client, self._connected_to = client, target
        self._known.clear()  # a new master holds nothing of what was put before
        return client


def _close_later(client: Any) -> None:
    """Close a store client on a thread of its own (unmounting its segment takes seconds)."""
    threading.Thread(target=client.close, name="mooncake-store-close", daemon=True).start()


def _resolve(future: asyncio.Future[StoreIO], io: StoreIO) -> None:
    if not future.done():
        future.set_result(io)
