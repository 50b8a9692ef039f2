"""vLLM's Mooncake connectors (PD and copies; the Store beside them), loadable on a CPU-only torch, and an orphan guard.

vLLM imports this module (``kv_connector_module_path``) inside its EngineCore process and its model
worker process. On import:

* ``torch.accelerator.current_device_index()`` raises on a CPU-only torch, and the connector's worker
  calls it once in its constructor; on such a torch it answers 0 (the CPU "device").
* On a CPU-only torch, vLLM's processes spin on their shared-memory message queues for 2 ms instead of a
  second after each message (``CPU_BUSY_LOOP_S``): on two cores, engines spinning between their steps
  took the cores from the other engine and from our services (measured in ``bench/results/compare/vllm``).
  And an EngineCore with work but nothing to run (a prefill's KV waiting for its decode worker's pull, a
  decode request waiting for its KV) steps empty every ``IDLE_STEP_S`` instead of every millisecond: each
  empty step is a round trip to the model runner, and on two cores those round trips, beside the
  connector's busy-polled sends, starved the very decode engine whose pull they waited for.
* A daemon thread ends this process as soon as its parent is gone. vLLM's children do not reliably die
  with a SIGKILLed parent (vllm#55510): an orphaned EngineCore keeps its bootstrap, ZMQ and transfer
  ports and over a gigabyte of memory. A worker killed with kill -9 must leave nothing behind.
* The KV data plane stays on ``[cluster] host`` (``VLLM_HOST_IP``, set by ``vllm_engine.engine_arguments``):
  vLLM starts the connector's bootstrap HTTP server on ``0.0.0.0`` and Mooncake binds its transfer engine
  to the wildcard; the first is given the host instead, the second goes through ``bind_guard`` as our own
  engine does. (The ZMQ side channel already binds ``VLLM_HOST_IP``.)
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import types
from typing import Any

import torch

CPU_ONLY = not torch.accelerator.is_available()
if CPU_ONLY:
    torch.accelerator.current_device_index = lambda: 0

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (  # noqa: E402
    MooncakeBootstrapServer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (  # noqa: E402
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
    MultiKVConnectorPromMetrics,
)
from vllm.v1.engine import core as engine_core  # noqa: E402

from services.worker.kv import bind_guard  # noqa: E402

PARENT_POLL_S = 0.5
# After each message from its scheduler, a vLLM process spins on its shared-memory queue (sched_yield) for a
# second before it sleeps on a socket. On a CPU-only host every engine of the cluster shares the cores with
# its peers and our services: there the spin is cut to this long.
CPU_BUSY_LOOP_S = 0.002
# vLLM's EngineCore sleeps 1 ms between empty steps (the only sleep in its module); on a CPU-only host, this long.
IDLE_STEP_S = 0.005
_spin_wait = shm_broadcast.SpinCondition.wait


def _wait_briefly(self: shm_broadcast.SpinCondition, timeout_ms: int | None = None) -> None:
    self.busy_loop_s = min(self.busy_loop_s, CPU_BUSY_LOOP_S)
    _spin_wait(self, timeout_ms)


def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


HOST = os.environ.get("VLLM_HOST_IP", "")


class _BootstrapOnHost(MooncakeBootstrapServer):
    """vLLM's bootstrap server, on the cluster's address instead of every interface."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(HOST or host, port)


if HOST and not bind_guard.resolve(HOST).is_unspecified:
    import mooncake.store  # noqa: F401  # the Store client's objects, confined with the engine's

    mooncake_connector.MooncakeBootstrapServer = _BootstrapOnHost  # type: ignore[attr-defined]  # what it calls
    bind_guard.install(bind_guard.resolve(HOST))  # the module import above loaded Mooncake's engine


def _idle_step_sleep(seconds: float) -> None:
    time.sleep(max(seconds, IDLE_STEP_S))


if CPU_ONLY:
    shm_broadcast.SpinCondition.wait = _wait_briefly  # type: ignore[method-assign]
    _engine_time = types.ModuleType("time")  # the module's `time`, but with the longer idle step
    _engine_time.__dict__.update(time.__dict__)
    _engine_time.sleep = _idle_step_sleep  # type: ignore[attr-defined]
    engine_core.time = _engine_time  # type: ignore[attr-defined]

if multiprocessing.parent_process() is not None:  # one of vLLM's spawned processes, not the worker itself
    threading.Thread(target=_exit_with_parent, name="kvconductor-orphan-guard", daemon=True).start()


class CpuMooncakeConnector(MooncakeConnector):
    """vLLM's MooncakeConnector, unchanged (the class exists so that vLLM loads it from this module)."""


class _NoEvent:
    """A stream event on a host without one: the KV a save reads is written when ``wait_for_save`` runs."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuMooncakeStoreConnector(MooncakeStoreConnector):
    """vLLM's MooncakeStoreConnector, whose saves record a CUDA event; on a CPU-only torch they record none."""

    def wait_for_save(self) -> None:
        """Hand this step's saves to the connector's send thread."""
        if not CPU_ONLY:
            super().wait_for_save()  # type: ignore[no-untyped-call]
            return
        cuda_event = torch.cuda.Event
        torch.cuda.Event = _NoEvent  # type: ignore[misc,assignment]  # the save's only CUDA call, on this thread
        try:
            super().wait_for_save()  # type: ignore[no-untyped-call]
        finally:
            torch.cuda.Event = cuda_event  # type: ignore[misc]


class _ListedChildMetrics(MultiKVConnectorPromMetrics):
    """vLLM's MultiConnector Prometheus metrics, skipping the stats of a child that has none (the MooncakeConnector).

    vLLM's asserts instead, which kills the engine at the first step whose stats name such a child.
    """

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        listed = {k: v for k, v in transfer_stats_data.items() if k in self._prom_metrics}
        super().observe(listed, engine_idx)


class StoreTierConnector(MultiConnector):
    """vLLM's MultiConnector over the MooncakeConnector (PD and copies) and the Store connector.

    vLLM's MultiConnector drops its children's KV events (``get_kv_connector_kv_cache_events`` is a TODO
    there); this one passes on the Store connector's, so the blocks it puts reach the KV event publisher
    (``medium="cpu"``) and from it kvmeta, as Store blocks. Its Prometheus metrics skip the child without any.
    """

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:  # fmt: skip
        """The children's metrics, observed only for the children that have them."""
        built = super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        assert isinstance(built, MultiKVConnectorPromMetrics)
        return _ListedChildMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, built._prom_metrics)

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The KV events of the first child that has any (the Store connector's puts)."""
        return next(
            (e for e in (c.get_kv_connector_kv_cache_events() for c in self._connectors) if e is not None), None
        )
