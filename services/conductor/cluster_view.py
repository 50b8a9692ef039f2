"""The Conductor's view of the cluster: instances from etcd, their cost models and the work it assigned.

Records arrive from the registry watch (on its thread) and are applied on the event loop. Load is the
Conductor's own bookkeeping of what it sent where (``scheduler.booking``): T_queue of prefill work,
the decode batch and the KV blocks reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc

from kvconductor.v1 import colocated_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.instance import InstanceState
from services.common.instance_record import WORKER_ROLES, StoreRecord, WorkerRecord
from services.common.registry import InstanceEvent
from services.common.rpc import channel

log = logging.getLogger(__name__)
QUARANTINE_POLL_S = 0.25  # wait_for re-checks this often: quarantines end with time, not with events
CHANNEL_CLOSE_GRACE_S = 120.0
KVMETA_AVOID_S = 5.0


@dataclass
class InstanceView:
    """One worker instance: its record, a channel to it, and its state in the Conductor core."""

    record: WorkerRecord
    channel: grpc.aio.Channel
    state: InstanceState

    @property
    def role(self) -> str:
        """prefill, decode or colocated."""
        return self.state.role

    @property
    def instance_id(self) -> str:
        """Its id in etcd."""
        return self.state.instance_id

    @property
    def prefill_stub(self) -> prefill_pb2_grpc.PrefillStub:
        """Stub of the Prefill service."""
        return prefill_pb2_grpc.PrefillStub(self.channel)

    @property
    def decode_stub(self) -> decode_pb2_grpc.DecodeStub:
        """Stub of the Decode service."""
        return decode_pb2_grpc.DecodeStub(self.channel)

    @property
    def colocated_stub(self) -> colocated_pb2_grpc.ColocatedStub:
        """Stub of the Colocated service."""
        return colocated_pb2_grpc.ColocatedStub(self.channel)

    @property
    def worker_stub(self) -> worker_pb2_grpc.WorkerStub:
        """Stub of the Worker service (load, heartbeat, drain)."""
        return worker_pb2_grpc.WorkerStub(self.channel)


def _state(record: WorkerRecord, old: InstanceState | None) -> InstanceState:
    """The core's state from a record; bookings carry over from the instance's previous record."""
    costs = record.cost_model
    state = InstanceState(
        record.instance_id, record.role, costs.prefill, costs.decode, num_blocks=record.num_blocks,
        max_running=record.max_concurrent_requests, chunk_tokens=record.max_num_batched_tokens,
        profile=costs.profile, exports_kv=record.exports_kv, kv_connector=record.moves_kv_itself,
    )  # fmt: skip
    if old is not None:
        state.prefilling, state.decoding = old.prefilling, old.decoding
        state.foreign_prefilling, state.foreign_decoding = old.foreign_prefilling, old.foreign_decoding
    return state


class ClusterView:
    """Instances by role, kept in step with etcd."""

    def __init__(self, engine: str = "builtin") -> None:
        self.engine = engine  # [engine] backend: workers of another backend are refused (one backend per cluster)
        self.instances: dict[str, InstanceView] = {}
        self.store: StoreRecord | None = None  # the store service (the Mooncake Store), when one is registered
        self._kvmeta: dict[str, tuple[str, grpc.aio.Channel]] = {}  # kvmeta replicas by id: address, channel
        self._kvmeta_failed: dict[str, float] = {}  # kvmeta address -> until when it is asked last
        self._quarantine: dict[str, float] = {}  # instance -> monotonic time it may be used again
        self._suspects: dict[str, int | None] = {}  # stalled instance -> its engine beats when first probed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # set at every registry change (``wait_for``)
        self._departed: dict[str, tuple[InstanceView, asyncio.TimerHandle]] = {}  # left; channel closes later

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Apply registry events on ``loop`` from now on."""
        self._loop = loop

    def on_event(self, event: InstanceEvent) -> None:
        """Registry callback (any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply, event)

    def _apply(self, event: InstanceEvent) -> None:
        self._changed.set()
        if event.role == "kvmeta":
            self._apply_kvmeta(event)
            return
        if event.role == "store":
            self.store = event.record if event.kind == "put" and isinstance(event.record, StoreRecord) else None
            return
        if event.role not in WORKER_ROLES:
            return
        old = self.instances.pop(event.instance_id, None)
        if old is None or event.kind == "delete" or event.record is None:
            self._suspects.pop(event.instance_id, None)  # a new process of that name starts with a clean slate
        if event.kind == "delete" or event.record is None:
            log.info("%s %s left", event.role, event.instance_id)
            if old is not None:
                self._retire(old)
            return
        if old is None:  # back after its lease expired (a starved machine): the same process keeps its channel
            old = self._rejoin(event.instance_id, event.record.address)
        record = event.record
        assert isinstance(record, WorkerRecord), "the registry decodes a worker role's value as a WorkerRecord"
        if record.engine != self.engine:
            log.error("refusing %s %s: its engine is %r, this cluster's [engine] backend is %r (one engine per "
                      "cluster)", event.role, event.instance_id, record.engine, self.engine)  # fmt: skip
            return
        same_address = old is not None and old.record.address == record.address
        view = InstanceView(
            record,
            old.channel if old is not None and same_address else channel(record.address),
            _state(record, old.state if old is not None and same_address else None),
        )
        self.instances[event.instance_id] = view
        if old is None:
            log.info("%s %s joined at %s", event.role, event.instance_id, record.address)

    def _retire(self, view: InstanceView) -> None:
        """Close a departed instance's channel after a grace; calls in flight keep working meanwhile.

        In flight: a draining worker's streams, and the next call of a request already planned there.
        """
        loop = asyncio.get_running_loop()
        handle = loop.call_later(CHANNEL_CLOSE_GRACE_S, self._close_departed, view)
        previous = self._departed.pop(view.instance_id, None)
        if previous is not None:
            previous[1].cancel()
            asyncio.ensure_future(previous[0].channel.close())
        self._departed[view.instance_id] = (view, handle)

    def _close_departed(self, view: InstanceView) -> None:
        """The grace is over: close the channel and forget the view (a later registration starts afresh)."""
        if self._departed.get(view.instance_id, (None,))[0] is view:
            del self._departed[view.instance_id]
        asyncio.ensure_future(view.channel.close())

    def _rejoin(self, instance_id: str, address: str) -> InstanceView | None:
        """The departed view of an instance registering again at the same address (its channel, its bookings)."""
        departed = self._departed.get(instance_id)
        if departed is None or departed[0].record.address != address:
            return None
        del self._departed[instance_id]
        departed[1].cancel()
        return departed[0]

    def _apply_kvmeta(self, event: InstanceEvent) -> None:
        """Follow the kvmeta replicas (every worker publishes to each, so any one can answer)."""
        old = self._kvmeta.pop(event.instance_id, None)
        address = event.record.address if event.kind == "put" and event.record else ""
        if old is not None and old[0] == address:
            self._kvmeta[event.instance_id] = old
            return
        if old is not None:
            asyncio.ensure_future(old[1].close())
        if address:
            self._kvmeta[event.instance_id] = (address, channel(address))

    @property
    def kvmetas(self) -> list[tuple[str, grpc.aio.Channel]]:
        """The kvmeta replicas, newest first, the ones that failed a call lately last.

        Newest first: a replacement registers before the old one's lease expires.
        """
        now = time.monotonic()
        return sorted(reversed(self._kvmeta.values()), key=lambda k: self._kvmeta_failed.get(k[0], 0.0) > now)

    def kvmeta_failed(self, address: str) -> None:
        """A kvmeta replica did not answer: ask the others first for a while."""
        self._kvmeta_failed[address] = time.monotonic() + KVMETA_AVOID_S

    async def wait_for(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``ready()`` holds (checked at each registry change, and as quarantines end); whether it does."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, QUARANTINE_POLL_S))
        return True

    def pool(self, role: str, exclude: Collection[str] = ()) -> list[InstanceView]:
        """Instances of one role, by id, except quarantined, excluded and (while others are left) suspect ones.

        A suspect is the last resort rather than no instance at all: on a starved machine a slow worker's
        stall is usually the machine's, and refusing every request would be worse than serving it slowly
        (the watchdog still bounds each attempt there).
        """
        now = time.monotonic()
        live = sorted(
            (
                v
                for v in self.instances.values()
                if v.role == role and v.instance_id not in exclude and self._quarantine.get(v.instance_id, 0.0) <= now
            ),
            key=lambda v: v.instance_id,
        )
        return [v for v in live if v.instance_id not in self._suspects] or live

    async def pool_after_failures(self, role: str, failed: Collection[str], wait_s: float) -> list[InstanceView]:
        """For a retry: the role's instances but those that ``failed`` the request, else the failed ones that live on.

        With none left but them, a failed instance still registered serves the retry once its quarantine ends
        (within ``wait_s``): on a starved machine a KV write cut short by its timeout is rarely a dead worker,
        and a dead one's lease expires within its quarantine, so it drops out meanwhile.
        """
        pool = self.pool(role, exclude=failed)
        if pool or not failed:
            return pool
        await self.wait_for(lambda: bool(self.pool(role)), wait_s)
        return self.pool(role)

    def scheduling(self, instance_id: str, now: float) -> str:
        """How the Conductor treats the instance now: "suspect", "quarantined" or "ok"."""
        if instance_id in self._suspects:
            return "suspect"
        return "quarantined" if self._quarantine.get(instance_id, 0.0) > now else "ok"

    def suspect(self, instance_id: str) -> None:
        """An instance stalled a request: no new work until its engine shows progress (``watch_suspects``)."""
        if instance_id in self.instances and instance_id not in self._suspects:
            log.warning("%s is suspect (a request made no progress there): no new work until its engine moves",
                        instance_id)  # fmt: skip
            self._suspects[instance_id] = None

    @property
    def suspects(self) -> list[str]:
        """Instances that get no new work until they show progress."""
        return sorted(self._suspects)

    async def watch_suspects(self, period_s: float = 1.0) -> None:
        """Probe suspect instances; one whose engine loop turns again is back in the pools (runs for ever)."""
        while True:
            await asyncio.sleep(period_s)
            for instance_id in list(self._suspects):
                await self._probe(instance_id, period_s)

    async def _probe(self, instance_id: str, timeout_s: float) -> None:
        view = self.instances.get(instance_id)
        if view is None:
            self._suspects.pop(instance_id, None)
            return
        try:
            load = await view.worker_stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return  # no answer is no progress
        seen = self._suspects.get(instance_id)
        if seen is None:
            self._suspects[instance_id] = load.engine_beats
        elif load.engine_beats > seen:
            del self._suspects[instance_id]
            log.warning("%s shows progress again: back in the pools", instance_id)

    def quarantine(self, instance_id: str, seconds: float) -> None:
        """Avoid an instance that just failed a request until its lease would have expired, had it died."""
        self._quarantine[instance_id] = time.monotonic() + seconds

    def can_serve(self) -> bool:
        """Whether some request could be scheduled now: prefill and decode instances, or a colocated one."""
        return bool(self.pool("colocated")) or (bool(self.pool("prefill")) and bool(self.pool("decode")))

    def max_model_len(self) -> int:
        """The smallest context length any worker serves (0 when there is none)."""
        lengths = [v.record.max_model_len for v in self.instances.values()]
        return min(lengths, default=0)

    def block_size(self) -> int:
        """KV block size shared by the workers."""
        return next((v.record.block_size for v in self.instances.values()), 16)
