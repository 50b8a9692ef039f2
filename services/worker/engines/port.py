"""EnginePort: the one way a worker (prefill, decode, colocated) uses an engine.

A worker never touches an engine's internals: it adds requests and reads their step outputs, reserves
blocks for KV that arrives from elsewhere, pins, allocates and imports blocks for KV copies, reads the
KV layout the transfer engine needs, drains KV events, and asks for load and liveness. Adapters own
their engine's threading rules: ``BuiltinEngine`` (``services/worker/engines/builtin.py``) runs the
torch engine on its own thread; ``tests/fake_engine.py`` implements the port in a few lines for fast
in-process service tests.

Contract, for every adapter:

* ``generate`` / ``decode`` are async iterators of ``StepOutput``. Leaving one before its last output
  (an error, a cancelled caller) aborts the request and frees its blocks; the abort completes even if
  the caller is cancelled meanwhile.
* A prefill-only request (``prefill_only=True``) ends with its first token and holds its blocks until
  ``release``; its chunk-progress outputs name the blocks already final (see ``engine.outputs``).
* Calls raise :class:`EngineDied` once the engine is gone; ``died`` resolves at that moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_manager import StoredBlock
from engine.outputs import StepOutput
from engine.sampling import SamplingParams
from services.worker.engines.loop import EngineDied

__all__ = ["EngineDied", "EngineLoad", "EnginePort", "ImportedBlocks", "KVLayout", "RemotePrefill", "StepOutput"]


@dataclass(frozen=True)
class KVLayout:
    """The paged KV pool as the transfer engine and the etcd record see it."""

    block_size: int  # tokens per block
    num_blocks: int
    bytes_per_block: int  # K and V of every layer
    base_address: int  # address of block 0; blocks are contiguous
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int
    vocab_size: int

    @property
    def nbytes(self) -> int:
        """Size of the pool (register this much memory with the transfer engine)."""
        return self.num_blocks * self.bytes_per_block

    def block_address(self, block_id: int) -> int:
        """Address of the first byte of ``block_id``."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id {block_id} out of range [0, {self.num_blocks})")
        return self.base_address + block_id * self.bytes_per_block

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks holding ``num_tokens`` tokens (the last one may be partial)."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class RemotePrefill:
    """The prefill worker whose KV connector sends a decode request's prompt KV (``moves_kv_itself`` engines)."""

    engine_id: str
    bootstrap_addr: str


@dataclass(frozen=True)
class EngineLoad:
    """What the engine reports about itself."""

    num_waiting: int
    num_running: int
    num_free_blocks: int  # allocatable now, evictable cached blocks included
    num_total_blocks: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int


@dataclass
class ImportedBlocks:
    """A KV copy's blocks on the puller, between ``pin_cached_blocks``/``allocate_blocks`` and the request.

    ``held``: the puller's own leading blocks, pinned; ``targets``: allocated for the missing ones, of
    which the first ``num_copied`` were filled from the exporter. ``block_hashes`` and ``token_ids`` cover
    held + targets (``token_ids`` is the prompt; block i holds ``token_ids[i*bs:(i+1)*bs]``).
    """

    block_hashes: list[bytes]
    token_ids: list[int]
    held: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    num_copied: int = 0


class EnginePort(Protocol):
    """An engine, as a worker uses it."""

    layout: KVLayout
    # True when the engine moves prompt KV itself (vLLM's KV connector): to the decode worker (no reservations,
    # no block addresses) and between prefill workers (``export_prefix``/``import_prefix`` instead of the
    # block calls); False when the worker's transfer engine writes into reserved blocks and reads peers' pools.
    moves_kv_itself: bool

    @property
    def died(self) -> asyncio.Future[BaseException] | None:
        """Resolves when the engine dies (None before ``start``)."""

    def start(self) -> None:
        """Start serving (call from the event loop that will consume outputs)."""

    async def close(self) -> None:
        """Stop the engine."""

    def heartbeat(self) -> tuple[int, float]:
        """Liveness: (turns of the engine loop so far, seconds since the last one)."""

    def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        imported: ImportedBlocks | None = None,
    ) -> AsyncGenerator[StepOutput, None]:
        """Run a request; ``imported`` blocks (a KV copy) enter the prefix cache atomically with it."""

    async def release(self, request_id: str) -> None:
        """Free a finished prefill-only request's blocks (they stay in the prefix cache)."""

    async def abort(self, request_id: str) -> None:
        """Drop a request (waiting, running, held or reserved) and free its blocks; unknown ids are ignored."""

    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        remote: RemotePrefill | None = None,
    ) -> tuple[list[int] | None, int]:
        """Make room for a request whose prompt KV arrives from elsewhere; (blocks or None if too few, free count).

        ``moves_kv_itself`` engines are told here the ``remote`` prefill worker their connector pulls from, and
        take the request at ``decode``; they return no blocks (``[]``).
        """

    def decode(
        self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams
    ) -> AsyncGenerator[StepOutput, None]:
        """Decode a reserved request whose prompt KV is in place: the outputs after token 0 (the prefill's).

        If token 0 already ends the request, one finished output with no tokens.
        """

    async def pin_cached_blocks(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Hold the cached blocks of the longest leading run of ``block_hashes`` (without waiting for a step)."""

    async def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop references taken by ``pin_cached_blocks`` or ``allocate_blocks``."""

    async def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Blocks to receive copied KV; None if too few are free."""

    async def abandon_import(self, imported: ImportedBlocks) -> None:
        """Give back a KV copy's blocks when its request will not run (copied ones stay cached)."""

    async def export_prefix(self, export_id: str, token_ids: Sequence[int]) -> None:
        """``moves_kv_itself`` engines: send this prefix's KV to the peer that imports ``export_id``.

        Returns when the prefix's KV is ready to go.
        """

    async def import_prefix(self, export_id: str, token_ids: Sequence[int], source: RemotePrefill) -> bool:
        """``moves_kv_itself`` engines: pull the blocks of this prefix the pool lacks; whether they arrived.

        From ``source``'s export ``export_id``, into the prefix cache.
        """

    def held_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """``moves_kv_itself`` engines: leading blocks of ``block_hashes`` in the prefix cache now."""

    def take_kv_pushes(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each KV push the engine's own connector timed since the last call.

        ``[]`` unless ``moves_kv_itself``: the worker's transfer engine times the others' writes.
        """

    def take_store_loads(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each Mooncake Store read the engine's own connector timed since the last call.

        ``[]`` unless ``moves_kv_itself``: the worker reads the Store for the others itself (``pull_from_store``).
        """

    async def pop_kv_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        """(blocks stored, hashes of blocks removed) since the last call."""

    def pop_store_puts(self) -> list[bytes]:
        """Hashes of the blocks the engine's own KV connector put into the Mooncake Store since the last call.

        ``[]`` unless ``moves_kv_itself``: the worker writes the others' blocks through to the Store itself.
        """

    async def load(self) -> EngineLoad:
        """Queue, batch, free blocks and prefix-cache counters, now (without waiting for a step)."""

    def inject_fault(self, kind: str) -> None:
        """Test-only: "raise" kills the engine, "freeze" stops it, "thaw" lets it go on."""
