"""The Mooncake Store's master (``mooncake_master``, shipped in the mooncake-transfer-engine wheel) as a child.

The store service runs one master and keeps it running: when it exits (a crash, a kill -9) it is started
again on the same port, so the workers' store clients reconnect to it. A restarted master knows no object
from before (the Store is a lossy cache: every lookup then misses and the requests recompute), which
``generation`` tells the rest of the cluster: the start's wall-clock time, so that no start, not even one by a
restarted store service, repeats an earlier one's.

Its flags: the RPC port and address, its own Prometheus (metrics and admin HTTP) port and address (the
master's default for that one is 0.0.0.0, every interface), the eviction watermarks of ``[store]``, and a
short lease on objects just read (``default_kv_lease_ttl``) so that a block being read is not evicted under
the reader. Clients handshake peer to peer (``P2PHANDSHAKE``), so no metadata server runs.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import mooncake

from services.common.child_process import dies_with_parent
from services.common.config import StoreConfig
from services.common.net import free_port

log = logging.getLogger(__name__)

LEASE_TTL_MS = 5000  # an object read is kept at least this long (Mooncake's default_kv_lease_ttl)
STOP_TIMEOUT_S = 5.0


def new_generation(previous: int = 0) -> int:
    """The number of a master start: its wall-clock microsecond, above ``previous``."""
    return max(previous + 1, time.time_ns() // 1000)


def master_binary() -> Path:
    """``mooncake_master`` of the installed wheel."""
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise RuntimeError(f"mooncake_master not found at {path}; is mooncake-transfer-engine installed?")
    return path


class StoreMaster:
    """One ``mooncake_master`` child on ``host``, its output in the service's log.

    ``ensure_running`` starts it again when it died.
    """

    def __init__(self, config: StoreConfig, host: str) -> None:
        self.config = config
        self.host = host
        self.port = config.master_port or free_port()
        self.generation = 0  # the running start's new_generation(); each start begins with an empty pool
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """The master's RPC host:port, as store clients are given it."""
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The master's command line."""
        c = self.config
        return [str(master_binary()), f"--rpc_port={self.port}", f"--rpc_address={self.host}",
                f"--metrics_port={free_port()}", f"--metrics_host={self.host}",
                f"--eviction_high_watermark_ratio={c.eviction_high_watermark_ratio}",
                f"--eviction_ratio={c.eviction_ratio}", f"--default_kv_lease_ttl={LEASE_TTL_MS}"]  # fmt: skip

    def alive(self) -> bool:
        """Whether the child runs."""
        return self._process is not None and self._process.poll() is None

    def ensure_running(self) -> bool:
        """Start the master if it is not running; True if it was (re)started now."""
        if self.alive():
            return False
        if self._process is not None:
            log.warning("mooncake_master exited with %s; starting it again on %s (its objects are gone)",
                        self._process.returncode, self.address)  # fmt: skip
        self._process = subprocess.Popen(dies_with_parent(self.command()))  # logs to the store service's log
        self.generation = new_generation(self.generation)
        log.info("mooncake_master (pid %d, generation %d) on %s", self._process.pid, self.generation, self.address)
        return True

    @property
    def pid(self) -> int | None:
        """The running master's pid."""
        return self._process.pid if self.alive() and self._process is not None else None

    def stop(self) -> None:
        """Stop the child (SIGTERM, then SIGKILL)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def wait_accepting(self, timeout_s: float = 10.0) -> bool:
        """Whether the master's RPC port accepts a connection within ``timeout_s``."""
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex((self.host, self.port)) == 0:
                    return True
            time.sleep(0.1)
        return False
