"""The Conductor replicas a gateway sends requests to, and a Generate call that fails over between them.

Every Conductor registers in etcd; the gateway follows the registrations and spreads requests over the
replicas round-robin (each replica counts the others' load through the workers, services/conductor/
shared_load.py, so the spread need not be clever). ``[cluster] scheduler_endpoint`` is the replica used
while etcd lists none (and the only one of a worker's own endpoint, which does not discover).

A call whose Conductor fails goes on at another replica (``services/common/failover.py``); a replica that
failed is avoided for a while.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import grpc

from kvconductor.v1 import conductor_pb2, conductor_pb2_grpc
from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.failover import FAILOVER, failover_request
from services.common.registry import InstanceEvent, Registry, RegistryWatch
from services.common.rpc import channel

log = logging.getLogger(__name__)
CHANNEL_CLOSE_GRACE_S = 120.0  # a departed replica's channel is closed this long after it left etcd
AVOID_S = 5.0  # a replica that failed a call gets no new one for this long (unless it is the only one left)


class Conductors:
    """The registered Conductors, a channel to each."""

    def __init__(self, config: Config, discover: bool = True) -> None:
        self.fallback = config.cluster.scheduler_endpoint
        discovers = discover and bool(config.cluster.etcd_endpoints)
        self._registry: Registry | None = cluster_registry(config) if discovers else None
        self._watch: RegistryWatch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registered: dict[str, str] = {}  # instance id -> address
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> channel
        self._avoid: dict[str, float] = {}  # address -> monotonic time it may be used again
        self._turn = itertools.count()

    def _start(self) -> None:
        """Follow etcd from the serving event loop (on first use)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._registry is not None:
            self._watch = self._registry.watch(self.on_event, roles=("conductor",))

    def on_event(self, event: InstanceEvent) -> None:
        """Registry callback (any thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._apply, event)

    def _apply(self, event: InstanceEvent) -> None:
        old = self._registered.pop(event.instance_id, None)
        if event.kind == "put" and event.record is not None:
            self._registered[event.instance_id] = event.record.address
        if old is not None and old not in self._registered.values() and old != self.fallback:
            assert self._loop is not None  # gone (a replaced pod's address): close its channel after the calls on it
            self._loop.call_later(CHANNEL_CLOSE_GRACE_S, self._close_unused, old)

    def _close_unused(self, address: str) -> None:
        if address not in self._registered.values() and (closing := self._channels.pop(address, None)) is not None:
            asyncio.ensure_future(closing.close())

    def addresses(self) -> list[str]:
        """The replicas to use now, in this call's order of preference (round-robin, avoided ones last)."""
        self._start()
        known = sorted(set(self._registered.values())) or [self.fallback]
        start = next(self._turn) % len(known)
        turned = known[start:] + known[:start]
        now = time.monotonic()
        return sorted(turned, key=lambda a: self._avoid.get(a, 0.0) > now)  # stable: round-robin among equals

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel to one replica (made on first use)."""
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]

    async def status(self) -> conductor_pb2.GetStatusResponse:
        """``GetStatus`` of the first replica that answers (the last one's error when none does)."""
        addresses = self.addresses()
        for i, address in enumerate(addresses):
            try:
                stub = conductor_pb2_grpc.ConductorStub(self.channel(address))
                status: conductor_pb2.GetStatusResponse = await stub.GetStatus(
                    conductor_pb2.GetStatusRequest(), timeout=2.0
                )
                return status
            except grpc.aio.AioRpcError:
                if i == len(addresses) - 1:
                    raise
                self.failed(address)
        raise AssertionError("unreachable: addresses() is never empty")

    def failed(self, address: str) -> None:
        """A replica failed a call: avoid it for a while."""
        self._avoid[address] = time.monotonic() + AVOID_S

    def generate(self, request: conductor_pb2.GenerateRequest) -> FailoverCall:
        """Start ``Conductor.Generate`` at the replica whose turn it is."""
        return FailoverCall(self, request)

    def close(self) -> None:
        """Stop following etcd."""
        if self._watch is not None:
            self._watch.stop()


class FailoverCall:
    """A streaming Generate that goes on at another replica when its Conductor fails (``read``, ``cancel``)."""

    def __init__(self, conductors: Conductors, request: conductor_pb2.GenerateRequest) -> None:
        self._conductors = conductors
        self._request = request
        self._streamed: list[int] = []
        self._left = conductors.addresses()
        self._cancelled = False
        self._call: Any = None
        self._address = ""
        self._next_call()

    def _next_call(self) -> None:
        self._address = self._left.pop(0)
        request = failover_request(self._request, self._streamed)
        self._call = conductor_pb2_grpc.ConductorStub(self._conductors.channel(self._address)).Generate(request)

    async def read(self) -> Any:
        """The next message, or ``grpc.aio.EOF``; raises the last replica's error when none can go on."""
        while True:
            try:
                message = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if self._cancelled or e.code() not in FAILOVER or not self._left:
                    raise
                self._conductors.failed(self._address)
                log.warning("Conductor at %s failed %s (%s) after %d tokens: going on at %s", self._address,
                            self._request.request_id, e.code().name, len(self._streamed), self._left[0])  # fmt: skip
                self._next_call()
                continue
            if message is not grpc.aio.EOF:
                self._streamed.extend(message.token_ids)
            return message

    def cancel(self) -> None:
        """Stop the work (the client left)."""
        self._cancelled = True
        self._call.cancel()
