"""KV copies through an engine's own connector (vLLM): what the exporter starts, given what it holds."""

import asyncio
from types import SimpleNamespace

import pytest

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import prefill_pb2
from services.worker.engines.port import KVLayout
from services.worker.kv.copy import Exports

BLOCK = 4


class ConnectorEngine:
    """An engine whose connector moves its KV; it holds the first ``held`` blocks of any prefix asked."""

    moves_kv_itself = True

    def __init__(self, held: int) -> None:
        self.layout = KVLayout(BLOCK, 64, 1024, 0, 2, 1, 8, "float32", 64 * BLOCK, 256)
        self.held = held
        self.exports: list[tuple[str, list[int]]] = []
        self.finished = asyncio.Event()

    def held_prefix_blocks(self, block_hashes):
        return min(self.held, len(block_hashes))

    async def export_prefix(self, export_id, token_ids):
        self.exports.append((export_id, list(token_ids)))
        await self.finished.wait()  # the prefill of the export, until the test lets it end


def _exports(engine):
    config = SimpleNamespace(cluster=SimpleNamespace(kv_transfer_timeout_s=5.0))
    return Exports(SimpleNamespace(engine=engine, config=config, kv_bootstrap="http://127.0.0.1:9"))


def _request(tokens):
    return prefill_pb2.ExportBlocksRequest(block_hashes=prefix_block_hashes(tokens, BLOCK), token_ids=tokens)


def test_an_export_runs_only_the_blocks_cached_here_and_a_release_aborts_it():
    async def run():
        engine = ConnectorEngine(held=2)
        exports = _exports(engine)
        tokens = list(range(4 * BLOCK))
        response = await exports.export(_request(tokens))
        await asyncio.sleep(0)  # the export's request starts
        assert (response.num_blocks, response.transfer_endpoint) == (2, "http://127.0.0.1:9")
        assert engine.exports == [(response.export_id, tokens[: 2 * BLOCK])]  # never computes what it lacks
        assert not response.block_addresses
        assert await exports.release(response.export_id) and not await exports.release(response.export_id)

    asyncio.run(run())


def test_a_holder_that_evicted_the_prefix_starts_no_export():
    async def run():
        engine = ConnectorEngine(held=0)
        response = await _exports(engine).export(_request(list(range(4 * BLOCK))))
        assert (response.export_id, response.num_blocks) == ("", 0) and engine.exports == []

    asyncio.run(run())


def test_an_export_longer_than_the_context_is_refused_before_anything_starts():
    async def run():
        engine = ConnectorEngine(held=100)
        tokens = list(range(65 * BLOCK))  # one block past max_model_len (64 blocks)
        with pytest.raises(ValueError, match="exceed the model's context"):
            await _exports(engine).export(_request(tokens))
        assert engine.exports == []

    asyncio.run(run())
