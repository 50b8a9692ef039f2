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
pressure. Calls run on a worker thread; a failed or missing read only shrinks what is reused, a failed
put only leaves the block out. While the master is down the client's calls fail after Mooncake's own RPC
timeout (about 4 s), and for ``RETRY_AFTER_S`` after a failure the worker does not try again.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.config import Config
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent, Registry
from services.worker.engine_port import KVLayout

log = logging.getLogger(__name__)

LOCAL_BUFFER_BYTES = 16 << 20  # the client's own staging buffer (zero-copy calls do not use it)
RETRY_AFTER_S = 5.0  # after a failed connect or call, the Store is left alone this long
KNOWN_KEYS = 1 << 16  # keys this worker put or saw in the Store, remembered to skip asking again
RPC_FAILED = -900  # Mooncake's RPC_FAIL: the master is unreachable (other codes are one object's trouble)


@dataclass
class StoreIO:
    """What one put or fill moved."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    note: str = ""
    stored: list[builtins.bytes] = field(default_factory=list)  # a put's blocks now known in the Store (put or found)


class KVStore:
    """The worker's store client; connects lazily to the master its cluster's store service names."""

    def __init__(self, config: Config, layout: KVLayout, link_floor: Callable[[int], float] | None = None) -> None:
        self.config = config
        self.layout = layout
        self.link_floor = link_floor  # least seconds moving n bytes takes (an emulated engine's modeled link)
        self._prefix = f"{config.cluster.name}/{layout.dtype}/{layout.bytes_per_block}/"
        self._record: StoreRecord | None = None
        self._client: Any = None  # mooncake.store.MooncakeDistributedStore (untyped)
        self._connected_to: tuple[str, int] | None = None  # (master address, generation) of the client
        self._lock = threading.Lock()  # one store call at a time; the client is not documented thread-safe
        self._known: OrderedDict[str, None] = OrderedDict()
        self._quiet_until = 0.0

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
        elif event.kind == "delete":
            self._record = None

    @property
    def store_id(self) -> str:
        """The store service's instance id (the Store's holder name in kvmeta), "" when none is registered."""
        record = self._record
        return record.instance_id if record is not None else ""

    @property
    def available(self) -> bool:
        """Whether a store service is registered and the Store was not failing just now."""
        return self._record is not None and time.monotonic() >= self._quiet_until

    def key(self, block_hash: bytes) -> str:
        """The Store key of a block of this cluster's KV layout."""
        return self._prefix + block_hash.hex()

    async def put(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> StoreIO:
        """Put the blocks the Store lacks (their memory must stay valid until this returns)."""
        return await asyncio.to_thread(self._timed, self._put, list(block_hashes), list(block_ids))

    async def fill(self, block_hashes: Sequence[bytes], targets: Sequence[int]) -> StoreIO:
        """Read the leading run of ``block_hashes`` the Store holds into pool blocks ``targets``."""
        return await asyncio.to_thread(self._timed, self._fill, list(block_hashes), list(targets))

    def _timed(self, call: Callable[[list[bytes], list[int]], StoreIO], hashes: list[bytes], ids: list[int]) -> StoreIO:
        """``call``, then (on a modeled link) the rest of the time its bytes take there."""
        io = call(hashes, ids)
        if self.link_floor is not None and io.bytes:
            time.sleep(max(0.0, self.link_floor(io.bytes) - io.seconds))
            io.seconds = max(io.seconds, self.link_floor(io.bytes))
        return io

    async def holds(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the Store holds now."""
        return await asyncio.to_thread(self._leading, list(block_hashes))

    def _put(self, hashes: list[bytes], block_ids: list[int]) -> StoreIO:
        fresh = [(h, b) for h, b in zip(hashes, block_ids, strict=True) if self.key(h) not in self._known]
        if not fresh:
            return StoreIO()
        with self._lock:
            client = self._connect()
            if client is None:
                return StoreIO(note="store unavailable")
            start = time.perf_counter()
            present = client.batch_is_exist([self.key(h) for h, _ in fresh])
            todo = [(h, b) for (h, b), p in zip(fresh, present, strict=True) if p != 1]
            size = self.layout.bytes_per_block
            addresses = [self.layout.block_address(b) for _, b in todo]
            codes = client.batch_put_from([self.key(h) for h, _ in todo], addresses, [size] * len(todo)) if todo else []
            failed = {h for (h, _), code in zip(todo, codes, strict=True) if code != 0}
            if RPC_FAILED in codes:
                self._back_off("a put failed: the master is unreachable")
            stored = [h for h, _ in fresh if h not in failed]
            for h in stored:
                self._remember(self.key(h))
            put = len(todo) - len(failed)
            note = f"{len(failed)} puts failed ({min(codes)})" if failed else ""
            return StoreIO(put, put * size, time.perf_counter() - start, note, stored)

    def _fill(self, hashes: list[bytes], targets: list[int]) -> StoreIO:
        if not hashes or not targets:
            return StoreIO()
        with self._lock:
            client = self._connect()
            if client is None:
                return StoreIO(note="store unavailable")
            start = time.perf_counter()
            keys = [self.key(h) for h in hashes[: len(targets)]]
            size = self.layout.bytes_per_block
            results = client.batch_get_into(keys, [self.layout.block_address(b) for b in targets[: len(keys)]],
                                            [size] * len(keys))  # fmt: skip
            n = 0
            while n < len(results) and results[n] == size:
                n += 1
            note = "" if n == len(keys) else f"the Store had {n} of {len(keys)} blocks ({results[n]})"
            for k in keys[n:]:  # gone (evicted, or lost with its owner): put again by the next prefill of it
                self._known.pop(k, None)
            if n < len(results) and results[n] == RPC_FAILED:
                self._back_off("a read failed: the master is unreachable")
            return StoreIO(n, n * size, time.perf_counter() - start, note)

    def _leading(self, hashes: list[bytes]) -> int:
        with self._lock:
            client = self._connect()
            if client is None or not hashes:
                return 0
            present = client.batch_is_exist([self.key(h) for h in hashes])
            n = 0
            while n < len(present) and present[n] == 1:
                n += 1
            return n

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _back_off(self, why: str) -> None:
        log.warning("Mooncake Store: %s; leaving it alone for %.0f s", why, RETRY_AFTER_S)
        self._quiet_until = time.monotonic() + RETRY_AFTER_S
        self._client, self._connected_to = None, None
        self._known.clear()

    def _connect(self) -> Any:
        """The client for the current master (reconnecting after its restart), or None."""
        record = self._record
        if record is None or time.monotonic() < self._quiet_until:
            return None
        target = (record.master_address, record.generation)
        if self._client is not None and self._connected_to == target:
            return self._client
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        segment = self.config.store.segment_mb << 20
        code = client.setup(self.config.cluster.host, "P2PHANDSHAKE", segment, LOCAL_BUFFER_BYTES, "tcp", "",
                            record.master_address)  # fmt: skip
        if code == 0:
            code = client.register_buffer(self.layout.base_address, self.layout.nbytes)
        if code != 0:
            self._back_off(f"cannot connect to the master at {record.master_address} ({code})")
            return None
        log.info("Mooncake Store: connected to %s (start %d), %d MiB contributed", record.master_address,
                 record.generation, self.config.store.segment_mb)  # fmt: skip
        self._client, self._connected_to = client, target
        self._known.clear()  # a new master holds nothing of what was put before
        return client
