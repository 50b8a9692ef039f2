"""The store service: the Mooncake Store's master for the cluster, registered in etcd as role ``store``.

With ``[store] master_address`` empty it runs ``mooncake_master`` itself (``services/store/master.py``) and
starts it again whenever it exits; with an address it only registers that master. Its etcd record
(``StoreRecord``) tells the workers where the master is and which start of it runs: a new start holds no
object from before. The service is SERVING while its master runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from services.common.cluster_registry import cluster_registry
from services.common.config import Config
from services.common.instance_record import StoreRecord
from services.common.registry import Registry
from services.common.rpc import serve
from services.store.master import StoreMaster, new_generation

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 0.5


class StoreService:
    """The master (run here or elsewhere) and the record that names it."""

    def __init__(self, config: Config, instance_id: str, registry: Registry) -> None:
        self.instance_id = instance_id
        self.registry = registry
        self.master = None if config.store.master_address else StoreMaster(config.store, config.cluster.host)
        self.master_address = self.master.address if self.master else config.store.master_address
        self.record: StoreRecord | None = None
        self._started = new_generation()  # an external master's generation: it may have restarted while we did not run

    def make_record(self, address: str, metrics_address: str) -> StoreRecord:
        """The etcd record, once the service listens on ``address``."""
        generation = self.master.generation if self.master else self._started
        self.record = StoreRecord("store", self.instance_id, address, metrics_address,
                                  master_address=self.master_address, generation=generation)  # fmt: skip
        return self.record

    async def start_master(self, _: str) -> None:
        """Before registering: the master runs and accepts connections."""
        if self.master is None:
            return
        self.master.ensure_running()
        if not await asyncio.to_thread(self.master.wait_accepting):
            raise RuntimeError(f"mooncake_master did not accept connections on {self.master_address}")

    def live(self) -> bool:
        """SERVING while the master runs (an external one is not watched)."""
        return self.master is None or self.master.alive()

    async def supervise(self) -> None:
        """Restart the master whenever it exits; publish its new generation."""
        if self.master is None:
            return
        while True:
            await asyncio.sleep(SUPERVISE_EVERY_S)
            if self.record is None or not self.master.ensure_running():
                continue
            await asyncio.to_thread(self.master.wait_accepting)
            self.record = dataclasses.replace(self.record, generation=self.master.generation)
            await asyncio.to_thread(self.registry.update, self.record)

    def stop(self) -> None:
        """Stop the master this service runs."""
        if self.master is not None:
            self.master.stop()


async def run(config: Config, instance_id: str) -> None:
    """Serve until SIGTERM: the master runs, is registered, and comes back when it dies."""
    service = StoreService(config, instance_id, cluster_registry(config))
    supervisor = asyncio.ensure_future(service.supervise())
    try:
        await serve(
            [], config.cluster.host, config.cluster.grpc_port, registry=service.registry, role="store",
            instance_id=instance_id, record=service.make_record, on_bound=service.start_master, live=service.live,
            metrics_port=config.telemetry.metrics_port,
        )  # fmt: skip
    finally:
        supervisor.cancel()
        service.stop()
