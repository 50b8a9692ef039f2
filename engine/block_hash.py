"""Block-hash specification shared by every process (Conductor, kvmeta, workers).

A block hash identifies the KV of one FULL block of ``block_size`` tokens *and of
every token before it*: the hash of block ``i`` chains the hash of block ``i - 1``.

    hash_0 = sha256(ROOT   || le_u32(tokens[0:bs]))
    hash_i = sha256(hash_{i-1} || le_u32(tokens[i*bs:(i+1)*bs]))
    ROOT   = sha256(BLOCK_HASH_SEED)

Hashes cross process boundaries, so they never depend on Python's ``hash()``.
This module must not import torch: the Conductor imports it on its own.
"""

import hashlib
import struct
from collections.abc import Sequence

BLOCK_HASH_SEED = b"kvconductor/block-hash/v1"
"""Fixed seed: changing it invalidates every published hash."""

_ROOT = hashlib.sha256(BLOCK_HASH_SEED).digest()
_MAX_TOKEN_ID = 2**32 - 1


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Return the 32-byte hash of a block given its parent's hash (None for the first block)."""
    if parent is not None and len(parent) != 32:
        raise ValueError(f"parent must be a 32-byte block hash, got {len(parent)} bytes")
    if any(t < 0 or t > _MAX_TOKEN_ID for t in token_ids):
        raise ValueError("token_ids must all fit in an unsigned 32-bit integer")
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256((_ROOT if parent is None else parent) + payload).digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Return the chained hashes of every full block of ``token_ids`` (a partial tail is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(token_ids) // block_size * block_size
    if num_full == 0:
        return []
    if min(token_ids[:num_full]) < 0 or max(token_ids[:num_full]) > _MAX_TOKEN_ID:
        raise ValueError("token_ids must all fit in an unsigned 32-bit integer")
    # Pack once and hash slices: the Conductor hashes every prompt, so this is on the request path.
    payload = struct.pack(f"<{num_full}I", *token_ids[:num_full])
    step = 4 * block_size
    hashes: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(payload), step):
        parent = hashlib.sha256(parent + payload[start : start + step]).digest()
        hashes.append(parent)
    return hashes
