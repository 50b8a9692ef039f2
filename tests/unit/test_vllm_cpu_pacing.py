"""On a CPU-only host the connector module paces vLLM's idle loops: the shared-memory queue's spin and the
EngineCore's empty steps (``services/worker/engines/vllm_connector.py``)."""

import subprocess
import sys
from pathlib import Path

PROBE = """
import time
from services.worker.engines import vllm_connector as c
from vllm.distributed.device_communicators import shm_broadcast
from vllm.v1.engine import core
assert c.CPU_ONLY
assert shm_broadcast.SpinCondition.wait is c._wait_briefly
started = time.perf_counter()
core.time.sleep(0.001)  # what the EngineCore sleeps between two empty steps
slept = time.perf_counter() - started
assert slept >= c.IDLE_STEP_S, slept
assert core.time.monotonic is time.monotonic and core.time.perf_counter is time.perf_counter
assert time.sleep is not core.time.sleep  # every other module keeps the real sleep
print("ok", round(slept, 4))
"""


def test_the_engine_core_steps_empty_at_most_every_idle_step():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok"), out.stdout
