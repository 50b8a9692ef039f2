"""KV data plane: moves KV cache blocks between instances over the Mooncake Transfer Engine.

Each instance runs one `KVTransferEngine` in P2P handshake mode (no metadata server) and
registers its KV pool tensor once. Peers address each other by `endpoint`
("host:rpcport"). A transfer names local and remote virtual addresses inside the two
registered regions; both sides must have registered the memory a transfer touches.

Coalescing: a batch is a list of (src, dst) block addresses of one block size. Runs of
consecutive entries where both the source and the destination advance by exactly the
run's length so far are merged into one entry before the call, in the caller's order::

    src  A      A+L    A+2L   B          ->   src  A (3L)   B (L)
    dst  X      X+L    X+2L   X+3L             dst  X (3L)   X+3L (L)

The engine has a fixed cost per entry, so a prefix of contiguous blocks (the common case
with a freshly allocated block table) moves as one large entry. Results and counters
still report the caller's blocks, not the merged entries.

Listening sockets. The engine's handshake (RPC) port and TCP data port are bound to ``host`` only, never to
every interface: the engine authenticates nobody, and whoever reaches those ports can read and overwrite the
registered pool. Mooncake itself binds them to the wildcard whatever ``host`` says; ``bind_guard.confined``
rewrites its binds and refuses an engine that still listens elsewhere (services/worker/kv/bind_guard.py).

The transfer calls block (without the GIL): call them from a worker thread to overlap them with compute.

Waiting without spinning. Mooncake's synchronous batch calls poll the batch's status in a loop that never
sleeps, so each transfer in flight keeps a thread on a core until its bytes land. On a machine short of cores
that thread takes the CPU that the engine's own threads, and the peer's, need to move those bytes: the slower
a transfer, the longer it spins. On two cores, twelve prefill workers spinning so tipped a full-pace cluster
into overload (their CPU tripled, every process slowed). Each entry is submitted here as an asynchronous
transfer of its own and the entries are checked with sleeps in between (``POLL_S``).

Modeled link. An emulated engine (``engine.emulated_runner``) keeps a few bytes per token where the
model it emulates keeps hundreds of KiB, so its KV crosses loopback almost for free. Given
``link_floor`` (seconds as a function of the bytes moved), a transfer moves the real bytes and then
waits out the rest of the modeled time, so transfers and the link models fitted from them see the
emulated link.
"""

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from mooncake.engine import TransferEngine

from services.worker.kv.bind_guard import confined

_PROTOCOLS = ("tcp", "rdma")
# A transfer the engine refuses is tried again after each of these waits before it fails. Mooncake's TCP
# transport rejects writes while its lane queues are full (a machine short of CPU under many concurrent
# transfers: "TCP lane queue-full rejection", status -1); failing such a write over to another decode
# worker turns a busy moment into lost attempts. A peer that is gone fails all of them: 0.75 s more.
RETRY_BACKOFF_S = (0.05, 0.2, 0.5)
# Entries (contiguous runs) per engine call. A prompt written into a fragmented pool (a colocated worker's
# free blocks are scattered between its cached ones) is a run per block: thousands of entries submitted at
# once fill the TCP transport's lane queues and every try of the write is refused; in batches they flow.
MAX_ENTRIES = 128
INVALID_BATCH = (1 << 64) - 1  # what an asynchronous submit returns when it cannot open the peer's segment
POLL_S = (0.0002, 0.002)  # the first and the longest sleep between two status checks of the entries in flight
TIMEOUT_S = 30.0  # an entry still in flight this long after its call began (plus 1 s per GB) has failed


class TransferError(RuntimeError):
    """A transfer returned a nonzero status."""


@dataclass(frozen=True)
class TransferResult:
    """What one transfer call moved and how long it took."""

    bytes: int
    blocks: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def coalesce(src_addrs: Sequence[int], dst_addrs: Sequence[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive entries contiguous on both sides; return (srcs, dsts, lengths)."""
    srcs: list[int] = []
    dsts: list[int] = []
    lengths: list[int] = []
    for src, dst in zip(src_addrs, dst_addrs, strict=True):
        if lengths and srcs[-1] + lengths[-1] == src and dsts[-1] + lengths[-1] == dst:
            lengths[-1] += length
        else:
            srcs.append(src)
            dsts.append(dst)
            lengths.append(length)
    return srcs, dsts, lengths


@dataclass
class TransferCounts:
    """KV moved by one process's transfer engine: the one count behind ``GetLoad`` and ``/metrics``.

    Written and read are this process's own transfers (a prefill's send, a KV copy's read); received is what
    peers wrote into its memory, which a one-sided write does not tell it: the request that consumes the
    blocks counts them (``count_received``).
    """

    bytes_written: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    blocks_read: int = 0
    bytes_received: int = 0
    blocks_received: int = 0
    retries: int = 0  # transfers tried again after the engine refused them (``RETRY_BACKOFF_S``)

    def by_direction(self) -> dict[str, int]:
        """Bytes by the ``direction`` label of ``kvconductor_kv_transfer_bytes_total``."""
        return {"sent": self.bytes_written, "copied_in": self.bytes_read, "received": self.bytes_received}


class KVTransferEngine:
    """One Mooncake Transfer Engine per process, with its byte and block counts."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        merge: bool = True,
        link_floor: Callable[[int], float] | None = None,
    ) -> None:
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        self.host = host
        self.protocol = protocol
        self.merge = merge
        self.link_floor = link_floor  # least seconds a transfer of n bytes takes (a modeled link)
        self._engine = TransferEngine()
        with confined(host):  # after `import mooncake.engine`, which loads the objects it patches
            status = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if status != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}, "
                f"{device_name!r}) returned {status}"
            )
        self._lock = threading.Lock()
        self._counts = TransferCounts()

    @property
    def endpoint(self) -> str:
        """The address peers use for this engine, "host:rpcport"."""
        return f"{self.host}:{self._engine.get_rpc_port()}"

    def register(self, ptr: int, nbytes: int) -> None:
        """Register [ptr, ptr + nbytes) for transfers (the KV pool tensor's storage)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        status = self._engine.register_memory(ptr, nbytes)
        if status != 0:
            raise RuntimeError(f"register_memory({ptr:#x}, {nbytes}) returned {status}")

    def write_blocks(
        self, peer_endpoint: str, src_addrs: Sequence[int], dst_addrs: Sequence[int], length: int
    ) -> TransferResult:
        """Write local blocks at `src_addrs` to the peer's `dst_addrs`, `length` bytes each."""
        result = self._transfer("write", peer_endpoint, src_addrs, dst_addrs, length)
        with self._lock:
            self._counts.bytes_written += result.bytes
            self._counts.blocks_written += result.blocks
        return result

    def read_blocks(
        self, peer_endpoint: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], length: int
    ) -> TransferResult:
        """Read the peer's blocks at `remote_addrs` into local `local_addrs`, `length` bytes each."""
        result = self._transfer("read", peer_endpoint, local_addrs, remote_addrs, length)
        with self._lock:
            self._counts.bytes_read += result.bytes
            self._counts.blocks_read += result.blocks
        return result

    def _transfer(self, op: str, peer: str, local: Sequence[int], remote: Sequence[int], length: int) -> TransferResult:
        if len(local) != len(remote):
            raise ValueError(f"{len(local)} local addresses but {len(remote)} remote addresses")
        if length <= 0:
            raise ValueError(f"block length must be positive, got {length}")
        if not local:
            return TransferResult(0, 0, 0.0)
        if self.merge:
            srcs, dsts, lengths = coalesce(local, remote, length)
        else:
            srcs, dsts, lengths = list(local), list(remote), [length] * len(local)
        start = time.perf_counter()
        for i in range(0, len(srcs), MAX_ENTRIES):
            batch = srcs[i : i + MAX_ENTRIES], dsts[i : i + MAX_ENTRIES], lengths[i : i + MAX_ENTRIES]
            status = self._call(op, peer, *batch)
            for wait in RETRY_BACKOFF_S:  # the same bytes to the same addresses: a partial first try is overwritten
                if status == 0:
                    break
                time.sleep(wait)
                with self._lock:
                    self._counts.retries += 1
                status = self._call(op, peer, *batch)
            if status != 0:
                raise TransferError(
                    f"{op} of {len(local)} blocks x {length} B ({len(srcs)} entries) with {peer} returned {status}"
                    f" ({len(RETRY_BACKOFF_S) + 1} tries)"
                )
        seconds = time.perf_counter() - start
        if self.link_floor is not None:
            time.sleep(max(0.0, self.link_floor(len(local) * length) - seconds))
            seconds = time.perf_counter() - start
        return TransferResult(len(local) * length, len(local), seconds)

    def _call(self, op: str, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """Move the entries and wait for all of them, sleeping between checks: 0 when every one landed.

        Each entry is a transfer of its own (the engine tells a batch's status without blocking only for its first
        entry). Nonzero: an entry the engine refused (-1, as its TCP lanes do when their queues are full, or an
        unknown peer), failed (-1) or timed out (-2); the entries already in flight are waited for all the same.
        """
        submit = self._engine.batch_transfer_async_write if op == "write" else self._engine.batch_transfer_async_read
        deadline = time.monotonic() + TIMEOUT_S + sum(lengths) / 1e9
        status, pending = 0, []
        for src, dst, length in zip(srcs, dsts, lengths, strict=True):
            batch_id = submit(peer, [src], [dst], [length])
            if batch_id in (0, INVALID_BATCH):
                status = -1
                break
            pending.append(batch_id)
        wait = POLL_S[0]
        while pending:
            checked = [(b, self._engine.transfer_check_status(b)) for b in pending]
            pending = [b for b, s in checked if s == 0]
            status = next((s for _, s in checked if s < 0), status)
            if pending and time.monotonic() > deadline:
                return -2  # their batch ids stay allocated: the engine frees one only when it completes or fails
            if pending:
                time.sleep(wait)
                wait = min(2 * wait, POLL_S[1])
        return status

    def count_written(self, blocks: int, nbytes: int) -> None:
        """Count blocks this process's engine wrote to a peer through a transfer engine of its own (vLLM's)."""
        with self._lock:
            self._counts.bytes_written += nbytes
            self._counts.blocks_written += blocks

    def count_received(self, blocks: int, nbytes: int) -> None:
        """Count blocks a peer wrote into this process's memory."""
        with self._lock:
            self._counts.bytes_received += nbytes
            self._counts.blocks_received += blocks

    def counts(self) -> TransferCounts:
        """The counts now (a copy; any thread)."""
        with self._lock:
            return replace(self._counts)
