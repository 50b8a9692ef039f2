"""Stub colocated workers that answer at once: what is left of a request's time is the Conductor's own.

One process serves N instances, each on a gRPC port of its own, registered in etcd under its own lease with a
real record (the analytic GPU profile's cost models, so every request is admitted), and publishing to kvmeta a
random-length prefix of every base prompt it is given plus unrelated blocks (as ``bench.conductor.run`` lays
out its KV index). ``Colocated.Generate`` streams ``max_tokens`` tokens in one chunk each, without waiting;
``Worker.GetLoad`` and ``WatchLoad`` report an idle engine whose loop turns.

    python -m bench.conductor.fleet --config C --instances 64 --prompts prompts.json   (started by serve.py)

It prints ``ready`` on stdout once every instance is registered and its blocks are in every kvmeta.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from engine.block_hash import prefix_block_hashes
from kvconductor.v1 import colocated_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from scheduler.profiles import analytic_gpu
from services.common.cluster_registry import cluster_registry
from services.common.config import Config, load_config
from services.common.instance_record import CostModels, KVShape, WorkerRecord
from services.common.registry import Registry
from services.worker.kv.events import KvEventPublisher

NUM_BLOCKS = 1 << 20  # free blocks each stub reports: never the limit
MAX_MODEL_LEN = 131_072
VOCAB_SIZE = 50_000
UNRELATED_BLOCKS = 64  # blocks of other prompts each instance holds beside the base prompts' prefixes


class StubWorker(worker_pb2_grpc.WorkerServicer, colocated_pb2_grpc.ColocatedServicer):  # type: ignore[misc]
    """One instance: every request is served at once, the engine is idle and turning."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.beats = 0

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: Any) -> worker_pb2.WorkerLoad:  # noqa: N802
        """An idle engine with every block free; its loop turns at each call."""
        self.beats += 1
        return worker_pb2.WorkerLoad(instance_id=self.instance_id, role="colocated", num_free_blocks=NUM_BLOCKS,
                                     num_total_blocks=NUM_BLOCKS, engine_beats=self.beats)  # fmt: skip

    async def WatchLoad(  # noqa: N802
        self, request: worker_pb2.WatchLoadRequest, context: Any
    ) -> AsyncIterator[worker_pb2.LoadReport]:
        """No request of another Conductor, once a second."""
        while True:
            yield worker_pb2.LoadReport()
            await asyncio.sleep(1.0)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[common_pb2.TokenChunk]:  # noqa: N802
        """``max_tokens`` tokens, one chunk each, the last with its finish reason."""
        n = max(1, request.sampling.max_tokens)
        for i in range(n):
            last = i == n - 1
            yield common_pb2.TokenChunk(token_ids=[100 + i % 100],
                                        finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)  # fmt: skip


def record(config: Config, instance_id: str, address: str) -> WorkerRecord:
    """A colocated worker's record with the analytic GPU profile's cost models."""
    profile = analytic_gpu()
    models = CostModels(profile.prefill, profile.decode, (profile.prefill, profile.decode))
    return WorkerRecord(role="colocated", instance_id=instance_id, address=address, model=config.model.name,
                        block_size=config.block_size, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                        vocab_size=VOCAB_SIZE, max_num_batched_tokens=8192, max_concurrent_requests=1 << 16,
                        kv_layout=KVShape(80, 8, 128, "bfloat16", 64 * 1024), cost_model=models,
                        engine=config.engine.backend)  # fmt: skip


def held_blocks(prompts: list[list[int]], block_size: int, rng: random.Random) -> list[bytes]:
    """A random-length prefix of every base prompt, and unrelated blocks."""
    held: list[bytes] = []
    for prompt in prompts:
        hashes = prefix_block_hashes(prompt, block_size)
        held += hashes[: rng.randrange(len(hashes) + 1)]
    other = [rng.randrange(VOCAB_SIZE) for _ in range(UNRELATED_BLOCKS * block_size)]
    return held + prefix_block_hashes(other, block_size)


async def start_instance(config: Config, instance_id: str, blocks: list[bytes]) -> tuple[grpc.aio.Server, Registry]:
    """Serve one stub on a free port, register it, and publish its blocks to every kvmeta."""
    server = grpc.aio.server()
    stub = StubWorker(instance_id)
    worker_pb2_grpc.add_WorkerServicer_to_server(stub, server)
    colocated_pb2_grpc.add_ColocatedServicer_to_server(stub, server)
    port = server.add_insecure_port(f"{config.cluster.host}:0")
    await server.start()
    registry = cluster_registry(config)
    registry.register(record(config, instance_id, f"{config.cluster.host}:{port}"))
    await KvEventPublisher(registry, instance_id).publish(blocks, [])
    return server, registry


async def run(config: Config, instances: int, prompts: list[list[int]], seed: int) -> None:
    """Serve ``instances`` stubs until SIGTERM."""
    rng = random.Random(seed)
    started = []
    for i in range(instances):
        started.append(await start_instance(config, f"stub-{i}", held_blocks(prompts, config.block_size, rng)))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for server, registry in started:
        registry.close()
        await server.stop(0)


def main() -> int:
    """Parse the flags and serve."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the cluster's TOML config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--instances", type=int, required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of base prompts (token id lists)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    asyncio.run(run(load_config(args.config, args.set), args.instances, prompts, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
