"""What every engine worker process shares: the engine, its KV data plane, the profile, the etcd record.

A worker process (prefill, decode or colocated) builds one :class:`Worker`: it pins torch to its
thread budget, loads the model and allocates the paged KV pool, registers the pool with the Mooncake
Transfer Engine, measures its own cost models, and then serves its role's RPCs plus ``Worker.GetLoad``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling import SamplingParams
from kvconductor.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from scheduler.cost_model import DecodeModel, PrefillModel
from services.common import metrics
from services.common.config import Config, WorkerConfig
from services.common.instance_record import CostModels, KVShape, StoreRecord, WorkerRecord
from services.common.registry import Registry
from services.common.rpc import Service
from services.worker.engines import builtin
from services.worker.engines.port import EnginePort
from services.worker.kv.events import KvEventPublisher
from services.worker.kv.store import KVStore
from services.worker.kv.transfer import KVTransferEngine
from services.worker.kv.zmq_events import ZmqKvEventPublisher
from services.worker.ledger import Ledger
from services.worker.profiling.refiner import CostRefiner

log = logging.getLogger(__name__)
STORE_SERVICE_WAIT_S = 120.0


@dataclass
class Worker:
    """One engine worker's shared state."""

    role: str
    instance_id: str
    config: Config
    pool_config: WorkerConfig
    engine: EnginePort
    transfer: KVTransferEngine
    registry: Registry
    events: KvEventPublisher
    refiner: CostRefiner
    prefill_model: PrefillModel
    decode_model: DecodeModel
    num_reserved: Callable[[], int] = lambda: 0
    address: str = ""  # set when the server is bound
    metrics_address: str = ""
    openai_url: str = ""  # a colocated worker's own OpenAI endpoint, once it listens
    kv_bootstrap: str = ""  # a vLLM prefill worker's KV connector bootstrap server
    zmq_events: ZmqKvEventPublisher | None = None  # [engine] zmq_kv_events
    store: KVStore | None = None  # [store] enabled, on a prefill worker whose pool the worker moves itself
    store_id: str = ""  # [store] enabled, on a vLLM prefill worker: the Store its connector puts into
    ledger: Ledger = field(default_factory=Ledger)  # the requests held, with their Conductors' bookings

    def record(self, address: str, metrics_address: str) -> WorkerRecord:
        """The etcd record describing this instance."""
        self.address, self.metrics_address = address, metrics_address
        layout = self.engine.layout
        return WorkerRecord(
            role=self.role, instance_id=self.instance_id, address=address, metrics_address=metrics_address,
            model=self.config.model.name, transfer_endpoint=self.transfer.endpoint, block_size=layout.block_size,
            num_blocks=layout.num_blocks, max_model_len=layout.max_model_len, vocab_size=layout.vocab_size,
            max_num_batched_tokens=self.pool_config.max_num_batched_tokens,
            max_concurrent_requests=self.pool_config.max_concurrent_requests,
            kv_layout=KVShape(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype,
                              layout.bytes_per_block),
            cost_model=CostModels(self.prefill_model, self.decode_model, self.refiner.profile_models()),
            openai_url=self.openai_url, engine=self.config.engine.backend, kv_bootstrap=self.kv_bootstrap,
            kv_events_endpoint=self.zmq_events.endpoint if self.zmq_events is not None else "",
        )  # fmt: skip

    def services(self) -> list[Service]:
        """The Worker service every role serves."""
        return [Service("kvconductor.v1.Worker", WorkerServicer(self), worker_pb2_grpc.add_WorkerServicer_to_server)]

    async def publish_kv_events(self, heartbeat: bool = False) -> None:
        """Send the engine's stored/evicted block hashes to kvmeta (and the blocks to ZMQ subscribers)."""
        stored, removed = await self.engine.pop_kv_events()
        if self.zmq_events is not None:
            self.zmq_events.publish(stored, removed)
        await self.events.publish([b.block_hash for b in stored], removed, heartbeat)
        if self.store_id:
            await self.events.publish_store(self.store_id, self.engine.pop_store_puts(), [])

    async def heartbeat_kv_events(self, period_s: float = 2.0) -> None:
        """Publish periodically, so kvmeta (re)learns this instance's blocks even when no request comes."""
        while True:
            await asyncio.sleep(period_s)
            await self.publish_kv_events(heartbeat=True)

    async def refine_cost_models(self, period_s: float = 5.0) -> None:
        """Refit the cost models from timed steps and republish the record (runs for the worker's lifetime)."""
        while True:
            await asyncio.sleep(period_s)
            models = self.refiner.refit()
            if models is None or not self.address:
                continue
            self.prefill_model, self.decode_model = models
            await asyncio.to_thread(self.registry.update, self.record(self.address, self.metrics_address))

    async def close(self) -> None:
        """Stop the engine and the event publisher."""
        await self.engine.close()
        await self.events.close()
        if self.zmq_events is not None:
            self.zmq_events.close()


async def build_worker(config: Config, role: str, instance_id: str, registry: Registry) -> Worker:
    """Load the model, allocate and register the KV pool, and fit the cost models."""
    pool_config: WorkerConfig = getattr(config, "decode" if role == "decode" else role)
    torch.set_num_threads(pool_config.torch_threads)
    engine: EnginePort
    kv_bootstrap = ""
    emulation = builtin.emulation_of(config) if config.engine.backend == "emulated" else None
    transfer = KVTransferEngine(
        config.cluster.host, protocol=config.cluster.transfer_backend,
        link_floor=None if emulation is None else emulation.transfer_seconds,
    )  # fmt: skip
    store_record = None
    if config.engine.backend == "vllm":
        from services.worker.engines import vllm_start  # imports vLLM: only on workers that run it

        if config.store.enabled and role == "prefill":
            store_record = await _store_service(registry)
        engine, refiner, kv_bootstrap = await vllm_start.build(
            config, role, instance_id, pool_config, transfer.count_written,
            store_master=store_record.master_address if store_record else "",
        )  # fmt: skip
    else:
        engine, refiner = builtin.build(config, role, pool_config, emulation, instance_id)
    if not engine.moves_kv_itself:
        transfer.register(engine.layout.base_address, engine.layout.nbytes)
    metrics.register_transfer(transfer.counts)
    prefill_model, decode_model = refiner.fit()
    log.info("%s %s: prefill model %s, decode model %s", role, instance_id, prefill_model, decode_model)
    events = KvEventPublisher(registry, instance_id)
    zmq_events = ZmqKvEventPublisher(config.cluster.host, config.block_size) if config.engine.zmq_kv_events else None
    store = None
    if config.store.enabled and role == "prefill" and not engine.moves_kv_itself:
        store = KVStore(config, engine.layout, transfer.link_floor)
        store.follow(registry)
    return Worker(
        role, instance_id, config, pool_config, engine, transfer, registry, events, refiner, prefill_model,
        decode_model, kv_bootstrap=kv_bootstrap, zmq_events=zmq_events, store=store,
        store_id=store_record.instance_id if store_record else "",
    )  # fmt: skip


async def _store_service(registry: Registry) -> StoreRecord:
    """The store service's record, once it is registered: a vLLM worker's Store client starts with vLLM."""
    deadline = asyncio.get_running_loop().time() + STORE_SERVICE_WAIT_S
    while True:
        records = [r for r in (await asyncio.to_thread(registry.list, "store")).values() if isinstance(r, StoreRecord)]
        if records:
            return records[0]
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(
                f"[store] enabled, but no store service registered in {STORE_SERVICE_WAIT_S:.0f} s "
                "(`kvconductor serve store` runs one)"
            )
        log.info("waiting for the store service to register (its master address starts vLLM's Store client)")
        await asyncio.sleep(1.0)


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Engine sampling parameters from the wire form (validated by the engine)."""
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,  # 0 means off on the wire; other bad values are refused
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )


FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def token_chunk(token_ids: list[int], finish_reason: str | None, num_cached_tokens: int = 0) -> common_pb2.TokenChunk:
    """One streamed message."""
    reason = FINISH_REASONS[finish_reason] if finish_reason else common_pb2.FINISH_REASON_UNSPECIFIED
    return common_pb2.TokenChunk(token_ids=token_ids, finish_reason=reason, num_cached_tokens=num_cached_tokens)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """``Worker.GetLoad`` and ``Worker.WatchLoad``."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: Any) -> worker_pb2.WorkerLoad:  # noqa: N802
        """Live load and counters."""
        w = self.worker
        load = await w.engine.load()  # its fields are WorkerLoad's, by name
        beats, age = w.engine.heartbeat()
        moved = w.transfer.counts()
        return worker_pb2.WorkerLoad(
            instance_id=w.instance_id, role=w.role, num_reserved=w.num_reserved(), **dataclasses.asdict(load),
            kv_bytes_sent=moved.bytes_written, kv_blocks_sent=moved.blocks_written,
            kv_bytes_received=moved.bytes_received, kv_blocks_received=moved.blocks_received,
            engine_beats=beats, engine_heartbeat_age_s=age,
        )  # fmt: skip

    async def WatchLoad(  # noqa: N802
        self, request: worker_pb2.WatchLoadRequest, context: Any
    ) -> AsyncIterator[worker_pb2.LoadReport]:
        """The requests other Conductors booked here, at every change (services/worker/ledger.py)."""
        async for report in self.worker.ledger.reports(request.conductor_id, request.period_s):
            yield report
