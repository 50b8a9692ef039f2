"""The KV data plane listens on the configured host only (issue 27: it stays on the cluster's network).

Mooncake binds its handshake port and its TCP data port to every interface whatever ``local_hostname`` says;
``KVTransferEngine`` and the Store client confine them (services/worker/kv/bind_guard.py), and the Store's master
gets its metrics/admin address as a flag. Each engine runs in a child process, as a
worker's does, and the test reads that process's listening sockets from ``/proc/<pid>`` (``ss -ltnp``'s
source) and connects to them through another address of this host: one on ``lo``, added for the test.
"""

from __future__ import annotations

import errno
import ipaddress
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import Config, StoreConfig
from services.common.instance_record import StoreRecord
from services.common.registry import InstanceEvent
from services.store.master import StoreMaster
from services.worker.engines.port import KVLayout
from services.worker.kv.bind_guard import ExposedListenerError, confined
from services.worker.kv.store import KVStore
from services.worker.kv.transfer import KVTransferEngine

POOL_BYTES = 1 << 20
BLOCK = 64 << 10


def _engine_main(conn: Connection, host: str) -> None:
    """A worker's engine on ``host``: a registered pool it can dump on request."""
    engine = KVTransferEngine(host)
    pool = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    engine.register(pool.data_ptr(), POOL_BYTES)
    conn.send((engine.endpoint, pool.data_ptr()))
    while conn.recv() == "dump":
        conn.send(pool.numpy().tobytes())


class Engine:
    def __init__(self, host: str) -> None:
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.proc: Any = multiprocessing.get_context("spawn").Process(
            target=_engine_main, args=(child, host), daemon=True
        )
        self.proc.start()
        if not self.conn.poll(60):
            self.close()
            raise RuntimeError(f"the engine on {host} did not start (exit code {self.proc.exitcode})")
        self.endpoint, self.base = self.conn.recv()

    def dump(self) -> bytes:
        self.conn.send("dump")
        data: bytes = self.conn.recv()
        return data

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _listeners(pid: int) -> set[tuple[str, int, str]]:
    """(address, port, socket inode) of every TCP listener in the network namespace of process ``pid``;
    ``::ffff:a.b.c.d`` given as ``a.b.c.d``."""
    found = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        for row in [line.split() for line in Path(table).read_text().splitlines()[1:]]:
            if row[3] != "0A":  # 0A: LISTEN
                continue
            hex_address, hex_port = row[1].split(":")
            words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
            address: Any = ipaddress.ip_address(struct.pack(f"={len(words)}I", *words))
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            found.add((str(address), int(hex_port, 16), row[9]))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (``ss -ltnp``'s source)."""
    inodes = _socket_inodes(pid)
    return {(address, port) for address, port, inode in _listeners(pid) if inode in inodes}


def held_elsewhere(pid: int, port: int) -> bool:
    """Whether a process other than ``pid`` listens on ``port`` (on any address): other tests' engines draw
    their ports from the same range, and one of them on 127.0.0.1 answers there, not ``pid``'s socket."""
    inodes = _socket_inodes(pid)
    return any(p == port and inode not in inodes for _, p, inode in _listeners(pid))


def reachable(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        code = sock.connect_ex((address, port))
    assert code in (0, errno.ECONNREFUSED), f"connect to {address}:{port}: {os.strerror(code)}"
    return code == 0


@pytest.fixture(scope="module")
def other_address() -> Iterator[str]:
    """A second address of this host, on ``lo`` (TEST-NET-2, unique per run), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("adding an address to lo needs root and the `ip` command (iproute2)")
    address = f"198.51.100.{1 + os.getpid() % 250}"
    subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True, capture_output=True, timeout=30)
    try:
        yield address
    finally:
        subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def loopback_engine() -> Iterator[Engine]:
    engine = Engine("127.0.0.1")
    try:
        yield engine
    finally:
        engine.close()


def test_the_engine_listens_on_its_host_only(loopback_engine: Engine) -> None:
    sockets = listening(loopback_engine.proc.pid)
    rpc_port = int(loopback_engine.endpoint.rsplit(":", 1)[1])
    assert rpc_port in {port for _, port in sockets}
    assert len(sockets) >= 2, sockets  # the handshake port and the TCP data port
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets


def test_another_address_of_the_host_reaches_no_engine_port(loopback_engine: Engine, other_address: str) -> None:
    ports = sorted(port for _, port in listening(loopback_engine.proc.pid))
    assert ports
    assert all(reachable("127.0.0.1", port) for port in ports)
    alone = [port for port in ports if not held_elsewhere(loopback_engine.proc.pid, port)]
    assert alone, ports
    assert not any(reachable(other_address, port) for port in alone)


def test_an_engine_on_another_address_serves_there_and_only_there(other_address: str) -> None:
    engine = Engine(other_address)
    try:
        sockets = listening(engine.proc.pid)
        assert {address for address, _ in sockets} == {other_address}, sockets
        alone = [port for _, port in sockets if not held_elsewhere(engine.proc.pid, port)]
        assert alone, sockets
        assert not any(reachable("127.0.0.1", port) for port in alone)
        # A peer still writes into its pool through the confined ports.
        local = KVTransferEngine("127.0.0.1")
        pool = torch.arange(POOL_BYTES, dtype=torch.int64).to(torch.uint8)
        local.register(pool.data_ptr(), POOL_BYTES)
        local.write_blocks(engine.endpoint, [pool.data_ptr() + BLOCK], [engine.base], BLOCK)
        assert engine.dump()[:BLOCK] == pool[BLOCK : 2 * BLOCK].numpy().tobytes()
    finally:
        engine.close()


def test_a_listener_left_on_every_interface_is_refused() -> None:
    with pytest.raises(ExposedListenerError, match="0.0.0.0"), confined("127.0.0.1"):
        sock = socket.socket()  # Python's own socket: not one of Mooncake's binds, so nothing rewrites it
        sock.bind(("0.0.0.0", 0))
        sock.listen()
    sock.close()


def test_the_store_master_and_a_store_client_listen_on_their_host_only() -> None:
    master = StoreMaster(StoreConfig(), "127.0.0.1")
    master.ensure_running()
    try:
        assert master.wait_accepting(), "mooncake_master did not come up"
        assert master.pid is not None
        deadline = time.monotonic() + 10
        while len(sockets := listening(master.pid)) < 2 and time.monotonic() < deadline:  # RPC and metrics
            time.sleep(0.1)
        assert master.port in {port for _, port in sockets}
        assert len(sockets) >= 2 and {address for address, _ in sockets} == {"127.0.0.1"}, sockets

        before = listening(os.getpid())
        pool = torch.zeros(16 * BLOCK, dtype=torch.uint8)
        config = Config()
        config.store = StoreConfig(enabled=True, segment_mb=16)
        layout = KVLayout(block_size=16, num_blocks=16, bytes_per_block=BLOCK, base_address=pool.data_ptr(),
                          num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32", max_model_len=1024,
                          vocab_size=256)  # fmt: skip
        store = KVStore(config, layout)
        record = StoreRecord("store", "store-0", "127.0.0.1:1", master_address=master.address, generation=1)
        store.on_event(InstanceEvent("put", "store", "store-0", record))
        deadline = time.monotonic() + 60
        while not store.connected:
            assert time.monotonic() < deadline, "the store client never connected"
            time.sleep(0.05)
        opened = listening(os.getpid()) - before  # the client's own Transfer Engine
        assert len(opened) >= 2 and {address for address, _ in opened} == {"127.0.0.1"}, opened
    finally:
        master.stop()
