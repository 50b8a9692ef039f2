"""A built-in worker's KV events in vLLM's ZMQ format, for routers that consume vLLM's (``vllm-router`` kv_aware).

With ``[engine] zmq_kv_events = true`` a worker binds a ZMQ PUB socket on a free port of its host and
names it in its etcd record (``kv_events_endpoint``). Each publish of the worker's KV events (the ones
kvmeta gets) is one message of three frames, as vLLM's ``ZmqEventPublisher`` sends them::

    topic (b"")    sequence number (8 bytes, big-endian, from 0)    msgpack KVEventBatch

The batch is ``[timestamp, events]`` (vLLM's array-like ``EventBatch``) and each event a tagged map:
``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
"medium", "lora_name"}`` per block (its own tokens, its parent's hash), ``{"type": "BlockRemoved",
"block_hashes", "medium"}``. The hashes are ours (32-byte chained SHA-256); such a router keys on them only
to chain parents and to remove blocks, and matches prompts by the blocks' token ids. There is no replay
socket: a subscriber that misses messages (it started late, its queue overflowed) learns the blocks
stored after that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from engine.block_manager import StoredBlock

MEDIUM = "GPU"  # the tier vllm-router credits in full (an emulated GPU's pool, or the CPU engine's only one)
SEND_HWM = 100_000  # messages queued per subscriber before ZMQ drops (vLLM's default)


def batch_payload(stored: Sequence[StoredBlock], removed: Sequence[bytes], block_size: int) -> bytes:
    """One msgpack ``KVEventBatch`` of the blocks stored and removed."""
    events: list[dict[str, Any]] = [
        {"type": "BlockStored", "block_hashes": [b.block_hash], "parent_block_hash": b.parent_hash,
         "token_ids": list(b.token_ids), "block_size": block_size, "lora_id": None, "medium": MEDIUM,
         "lora_name": None}
        for b in stored
    ]  # fmt: skip
    if removed:
        events.append({"type": "BlockRemoved", "block_hashes": list(removed), "medium": MEDIUM})
    return msgspec.msgpack.encode([time.time(), events])


class ZmqKvEventPublisher:
    """A PUB socket that sends each non-empty delta of KV events as one vLLM ``KVEventBatch``."""

    def __init__(self, host: str, block_size: int) -> None:
        self.block_size = block_size
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        port: int = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._seq = 0

    def publish(self, stored: Sequence[StoredBlock], removed: Sequence[bytes]) -> None:
        """Send one batch (nothing when both are empty); never blocks (PUB drops for a slow subscriber)."""
        if not stored and not removed:
            return
        payload = batch_payload(stored, removed, self.block_size)
        self._socket.send_multipart([b"", self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self._seq += 1

    def close(self) -> None:
        """Close the socket (messages not yet sent are dropped)."""
        self._socket.close(linger=0)
