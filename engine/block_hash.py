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

from engine._block_hash import chain, packed_ids

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


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Return the chained hashes of every full block of ``token_ids`` (a partial tail is skipped).

    ``parent``: the hash of the block just before ``token_ids`` (None: they start the sequence). The same
    hashes as ``hash_block`` block after block, computed in C (``engine/_block_hash.c``): the Conductor hashes
    every prompt, and an engine every block its requests fill, so this is on the request path.
    """
    _check_block_size(block_size)
    if parent is not None and len(parent) != 32:
        raise ValueError(f"parent must be a 32-byte block hash, got {len(parent)} bytes")
    try:
        return chain(token_ids, block_size, _ROOT if parent is None else parent)
    except TypeError:
        raise ValueError("token_ids must all be integers") from None


def packed_token_ids(wire: bytes, vocab_size: int) -> bytes:
    """A serialized ``TokenIds`` message's ids as little-endian uint32, each checked below ``vocab_size``.

    In C, without a Python int per token: a request's ``token_ids.ids`` read into a list cost the Conductor
    2 ms at 100k tokens, more than hashing them. ValueError names the first id outside the vocabulary.
    """
    return packed_ids(wire, vocab_size)


def packed_block_hashes(packed: bytes, block_size: int) -> list[bytes]:
    """``prefix_block_hashes`` of token ids packed by ``packed_token_ids``."""
    _check_block_size(block_size)
    return chain(packed, block_size, _ROOT)


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
