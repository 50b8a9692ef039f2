"""KV copy onto a prefill worker: a prompt's cached prefix from its best holder, or from the Mooncake Store.

From the Store the worker reads by block hash with its own store client (``pull_from_store``).

The puller (the prefill worker the Conductor chose) and the exporter (the best holder)::

    puller: pin its own leading blocks, allocate blocks for the missing ones
    exporter (ExportBlocks): pin the requested blocks it still holds, return their addresses
    puller: read them through the transfer engine into its allocated blocks
    exporter (ReleaseBlocks): unpin
    puller: register the copied blocks in its prefix cache, then add the request, which now hits them

An engine with its own KV connector (vLLM) copies through it instead (``pull_by_connector``): the exporter
runs the prefix as a request whose KV its connector sends (``EnginePort.export_prefix``), the puller runs it
as a request that pulls what it lacks into its prefix cache (``import_prefix``); the same two RPCs frame it.

A copy that cannot happen (blocks evicted meanwhile, exporter unreachable, no free blocks) shrinks or
is skipped: the request then computes what is missing, so a copy never fails a request. Exports are
pinned for at most ``kv_transfer_timeout_s``, so a puller that dies cannot leak the exporter's blocks.
The exporter pins and unpins without waiting for its engine's current step (a busy holder is exactly
the one a copy is planned from).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import prefill_pb2, prefill_pb2_grpc
from services.common.rpc import channel
from services.common.tasks import complete, spawn
from services.worker.engines.port import EnginePort, ImportedBlocks, RemotePrefill
from services.worker.kv.store import StoreIO
from services.worker.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class PrefixCopy:
    """A copy in progress on the puller: the blocks it holds and fills (``imported``) and how it went."""

    imported: ImportedBlocks
    bytes: int = 0
    seconds: float = 0.0
    note: str = ""

    @property
    def num_own(self) -> int:
        """Leading blocks the puller held already."""
        return len(self.imported.held)

    @property
    def num_copied(self) -> int:
        """Leading targets filled from the exporter."""
        return self.imported.num_copied

    async def prepare(self, engine: EnginePort) -> None:
        """Pin own leading blocks and allocate the missing ones (to the end, even if the caller is cancelled)."""

        async def prepare() -> None:
            imported = self.imported
            imported.held = await engine.pin_cached_blocks(imported.block_hashes, imported.token_ids)
            missing = len(imported.block_hashes) - len(imported.held)
            targets = await engine.allocate_blocks(missing) if missing else []
            if targets is None:
                self.note = f"no room for {missing} copied blocks"
            imported.targets = targets or []

        await complete(prepare())


async def pull_prefix(worker: Worker, copy: PrefixCopy, prompt: list[int], source: prefill_pb2.KVSource) -> None:
    """Read the blocks ``copy`` lacks from ``source``; records what arrived (never raises on a failed copy)."""
    if not copy.imported.targets:
        return
    block_size = worker.engine.layout.block_size
    first, last = copy.num_own, copy.num_own + len(copy.imported.targets)
    hashes = copy.imported.block_hashes[first:last]
    start = time.perf_counter()
    async with _export(worker, source, hashes, prompt[first * block_size : last * block_size], copy) as exported:
        if exported is None:
            return
        await _read(worker, copy, exported)
    copy.seconds = time.perf_counter() - start
    if copy.num_copied < len(copy.imported.targets):
        copy.note = f"{source.instance_id} had {copy.num_copied} of {len(copy.imported.targets)} blocks"


@dataclass
class ConnectorCopy:
    """A copy through the engine's own KV connector, as the puller saw it."""

    num_own: int  # leading blocks the puller held already (its KV events' view)
    num_copied: int = 0  # blocks pulled from the exporter
    bytes: int = 0
    seconds: float = 0.0
    note: str = ""


async def pull_by_connector(
    worker: Worker, prompt: list[int], num_blocks: int, source: prefill_pb2.KVSource
) -> ConnectorCopy:
    """Pull the first ``num_blocks`` prompt blocks this worker lacks from ``source`` through the engine's connector.

    Never raises on a failed copy: the prompt then computes the blocks.
    """
    engine, bs = worker.engine, worker.engine.layout.block_size
    tokens = prompt[: num_blocks * bs]
    hashes = prefix_block_hashes(tokens, bs)
    copy = ConnectorCopy(num_own=engine.held_prefix_blocks(hashes))
    if copy.num_own >= num_blocks:
        return copy
    start = time.perf_counter()
    async with _export(worker, source, hashes, tokens, copy) as exported:
        if exported is None:
            return copy
        exported_blocks = min(exported.num_blocks, num_blocks)
        if exported_blocks <= copy.num_own:
            copy.note = f"{source.instance_id} had {exported.num_blocks} of {num_blocks} blocks"
            return copy
        try:
            remote = RemotePrefill(source.instance_id, exported.transfer_endpoint)
            async with asyncio.timeout(worker.config.cluster.kv_transfer_timeout_s):
                arrived = await engine.import_prefix(exported.export_id, tokens[: exported_blocks * bs], remote)
        except Exception as e:  # noqa: BLE001 - a failed copy leaves the prompt to compute the blocks
            arrived, copy.note = False, f"the pull from {source.instance_id} failed: {e or type(e).__name__}"
    copy.seconds = time.perf_counter() - start
    if arrived:
        copy.num_copied = exported_blocks - copy.num_own
        copy.bytes = copy.num_copied * engine.layout.bytes_per_block
        if exported_blocks < num_blocks:
            copy.note = f"{source.instance_id} had {exported_blocks} of {num_blocks} blocks"
    elif not copy.note:
        copy.note = f"the pull from {source.instance_id} failed"
    return copy


def store_load_by_connector(worker: Worker, prompt: list[int], num_blocks: int) -> ConnectorCopy:
    """A planned read of the prompt's first ``num_blocks`` blocks from the Mooncake Store, by the engine's connector.

    vLLM's Store connector looks every prompt up in the Store and loads what the pool lacks as the prompt
    runs: nothing to do before it but note what the pool holds already (``settle_store_load`` after it).
    """
    bs = worker.engine.layout.block_size
    return ConnectorCopy(num_own=worker.engine.held_prefix_blocks(prefix_block_hashes(prompt[: num_blocks * bs], bs)))


async def settle_store_load(
    worker: Worker,
    copy: ConnectorCopy,
    prompt: list[int],
    num_blocks: int,
    num_cached_tokens: int,
    store_id: str,
    loads: list[tuple[int, float]],
) -> None:
    """After the prompt ran: what the connector loaded from the Store (its cached tokens beyond the pool's own).

    Its time is that of the Store reads the connector timed while the prompt ran (``loads``: they name no
    request; 0 when none was reported yet, and the Conductor then learns no link from it).

    Fewer blocks than planned: the first one missing is gone from the Store (evicted silently by its master, or
    lost with a restarted master or a segment's owner), and kvmeta is told, so the next plan does not count it.
    """
    layout = worker.engine.layout
    held = min(num_cached_tokens // layout.block_size, num_blocks)
    copy.num_copied = max(0, held - copy.num_own)
    copy.bytes = copy.num_copied * layout.bytes_per_block
    copy.seconds = sum(seconds for _, seconds in loads) if copy.num_copied else 0.0
    copy.note = "loaded by vLLM's Store connector as the prompt ran"
    if held < num_blocks:
        copy.note = f"{store_id} had {held} of {num_blocks} blocks"
        hashes = prefix_block_hashes(prompt[: (held + 1) * layout.block_size], layout.block_size)
        await worker.events.publish_store(store_id, [], [hashes[held]])


async def pull_from_store(worker: Worker, copy: PrefixCopy, store_id: str) -> None:
    """Read the blocks ``copy`` lacks from the Mooncake Store (never raises on a failed read).

    The read stops at the first block the Store no longer has (evicted, or lost with a restarted master or
    a crashed segment owner): kvmeta is told, so the next request is not planned on it (not when the Store
    did not answer: that says nothing about the block). A read the Store
    does not answer within ``[store] read_timeout_s`` is given up: its blocks go with it (given back when it
    ends) and the request computes the prompt instead.
    """
    store, targets = worker.store, copy.imported.targets
    if not targets:
        return
    if store is None:
        copy.note = "this worker has no store client ([store] enabled on a prefill worker)"
        return
    first = copy.num_own
    hashes = copy.imported.block_hashes[first : first + len(targets)]
    engine = worker.engine

    async def fill() -> StoreIO:
        io = await store.fill(hashes, targets)
        if io.pending is not None:  # the read goes on writing into the targets: they are its until it ends
            copy.imported.targets = []
            io.pending.add_done_callback(lambda _: spawn(engine.unpin_blocks(targets), "freeing a late read's blocks"))
        return io

    read = await complete(fill())  # to its end even if the caller is cancelled: the cleanup frees the targets
    copy.imported.num_copied, copy.bytes, copy.seconds = read.blocks, read.bytes, read.seconds
    if read.pending is not None:
        copy.note = f"{store_id}: {read.note}; recomputing"
    elif read.blocks < len(hashes):
        copy.note = f"{store_id}: {read.note}"
    if read.gone:
        await worker.events.publish_store(store_id, [], [hashes[read.blocks]])


async def _read(worker: Worker, copy: PrefixCopy, exported: prefill_pb2.ExportBlocksResponse) -> None:
    layout = worker.engine.layout
    if exported.bytes_per_block != layout.bytes_per_block:
        copy.note = f"KV layout mismatch ({exported.bytes_per_block} vs {layout.bytes_per_block} bytes per block)"
        return
    n = len(exported.block_addresses)
    local = [layout.block_address(b) for b in copy.imported.targets[:n]]
    read = asyncio.to_thread(
        worker.transfer.read_blocks, exported.transfer_endpoint, local, list(exported.block_addresses),
        layout.bytes_per_block,
    )  # fmt: skip
    try:
        result = await complete(read)  # the blocks being read into may only be freed once the read is over
    except RuntimeError as e:
        copy.note = f"transfer failed: {e}"
        return
    copy.imported.num_copied, copy.bytes = n, result.bytes


@contextlib.asynccontextmanager
async def _export(
    worker: Worker,
    source: prefill_pb2.KVSource,
    hashes: list[bytes],
    tokens: list[int],
    copy: PrefixCopy | ConnectorCopy,
) -> AsyncIterator[prefill_pb2.ExportBlocksResponse | None]:
    """Ask ``source`` to export these blocks, released when the block ends (``None``, noted on ``copy``: refused)."""
    timeout = worker.config.cluster.kv_transfer_timeout_s
    async with channel(source.address) as source_channel:
        stub = prefill_pb2_grpc.PrefillStub(source_channel)
        try:
            exported = await stub.ExportBlocks(
                prefill_pb2.ExportBlocksRequest(block_hashes=hashes, token_ids=tokens), timeout=timeout
            )
        except grpc.aio.AioRpcError as e:
            copy.note = f"{source.instance_id} did not export: {e.code().name}"
            yield None
            return
        try:
            yield exported
        finally:
            if exported.export_id:
                await _release(stub, exported.export_id, timeout)


async def _release(stub: prefill_pb2_grpc.PrefillStub, export_id: str, timeout: float) -> None:
    try:
        await stub.ReleaseBlocks(prefill_pb2.ReleaseBlocksRequest(export_id=export_id), timeout=timeout)
    except grpc.aio.AioRpcError as e:  # the exporter's expiry frees them
        log.warning("could not release export %s: %s", export_id, e.code().name)


class Exports:
    """The exporter's exports in progress, by export id, each with how to end it and its deadline."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._open: dict[str, tuple[Callable[[], Awaitable[None]], float]] = {}

    async def export(self, request: prefill_pb2.ExportBlocksRequest) -> prefill_pb2.ExportBlocksResponse:
        """Pin the leading run of the requested blocks still cached here.

        An engine with its own KV connector starts the request whose KV the connector sends to the puller.
        """
        hashes, tokens = list(request.block_hashes), list(request.token_ids)
        engine = self.worker.engine
        layout = engine.layout
        if len(tokens) != len(hashes) * layout.block_size:
            raise ValueError("token_ids must hold exactly the requested blocks' tokens")
        if len(tokens) > layout.max_model_len:  # a prefix no prompt here can have: nothing to pin or start
            raise ValueError(f"{len(tokens)} token_ids exceed the model's context ({layout.max_model_len} tokens)")
        export_id = uuid.uuid4().hex
        deadline = time.monotonic() + self.worker.config.cluster.kv_transfer_timeout_s
        if engine.moves_kv_itself:
            held = engine.held_prefix_blocks(hashes)  # an export of blocks not cached here would compute them
            if held == 0:
                return prefill_pb2.ExportBlocksResponse(bytes_per_block=layout.bytes_per_block)
            running = spawn(engine.export_prefix(export_id, tokens[: held * layout.block_size]), f"export {export_id}")

            async def stop() -> None:  # a request not done yet is aborted (its blocks were never sent)
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running

            self._open[export_id] = (stop, deadline)
            return prefill_pb2.ExportBlocksResponse(
                export_id=export_id, transfer_endpoint=self.worker.kv_bootstrap,
                bytes_per_block=layout.bytes_per_block, num_blocks=held,
            )  # fmt: skip

        async def pin() -> list[int]:  # on the books even if the caller goes away mid-way (then it expires)
            blocks = await engine.pin_cached_blocks(hashes, tokens)
            self._open[export_id] = (lambda: engine.unpin_blocks(blocks), deadline)
            return blocks

        blocks = await complete(pin())
        return prefill_pb2.ExportBlocksResponse(
            export_id=export_id,
            transfer_endpoint=self.worker.transfer.endpoint,
            block_addresses=[layout.block_address(b) for b in blocks],
            bytes_per_block=layout.bytes_per_block,
        )

    async def release(self, export_id: str) -> bool:
        """End an export (unpin its blocks); False if unknown (already released or expired)."""
        entry = self._open.pop(export_id, None)
        if entry is None:
            return False
        await entry[0]()
        return True

    async def expire(self) -> None:
        """Unpin exports past their deadline (runs for the worker's lifetime)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for export_id in [k for k, (_, deadline) in self._open.items() if deadline < now]:
                log.warning("export %s was never released; unpinning its blocks", export_id)
                await self.release(export_id)
