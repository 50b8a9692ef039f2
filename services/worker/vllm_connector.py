"""vLLM's MooncakeConnector, loadable on a CPU-only torch, and an orphan guard for vLLM's child processes.

vLLM imports this module (``kv_connector_module_path``) inside its EngineCore process and its model
worker process. Two things happen on import:

* ``torch.accelerator.current_device_index()`` raises on a CPU-only torch, and the connector's worker
  calls it once in its constructor; on such a torch it answers 0 (the CPU "device").
* A daemon thread ends this process as soon as its parent is gone. vLLM's children do not reliably die
  with a SIGKILLed parent (vllm#55510): an orphaned EngineCore keeps its bootstrap, ZMQ and transfer
  ports and over a gigabyte of memory. A worker killed with kill -9 must leave nothing behind.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector,
)

PARENT_POLL_S = 0.5


def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


if multiprocessing.parent_process() is not None:  # one of vLLM's spawned processes, not the worker itself
    threading.Thread(target=_exit_with_parent, name="kvconductor-orphan-guard", daemon=True).start()


class CpuMooncakeConnector(MooncakeConnector):
    """vLLM's MooncakeConnector, unchanged (the class exists so that vLLM loads it from this module)."""
