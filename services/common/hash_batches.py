"""Block hashes cut into gRPC messages of bounded size.

Every message that carries a list of block hashes (a worker's events and inventory to kvmeta, kvmeta's
changes to the Conductors that follow it) cuts the list with ``chunks``: gRPC refuses messages over 4 MiB,
and a whole inventory (190,464 blocks are 6.2 MiB) or a resync's removals can exceed it.
"""

from __future__ import annotations

from collections.abc import Sequence

# Bytes of block hashes per message: a quarter of gRPC's default 4 MiB limit, leaving room for
# the other fields (an instance id, a few integers) many times over.
MESSAGE_BUDGET = 1 << 20


def entry_bytes(block_hash: bytes) -> int:
    """Wire size of one entry of a repeated ``bytes`` field numbered below 16: tag, length varint, the hash."""
    n = len(block_hash)
    return 1 + max(1, (n.bit_length() + 6) // 7) + n


def chunks(hashes: Sequence[bytes], budget: int = MESSAGE_BUDGET) -> list[list[bytes]]:
    """``hashes`` cut in order into runs of at most ``budget`` wire bytes each (one empty run for none)."""
    runs: list[list[bytes]] = [[]]
    size = 0
    for h in hashes:
        n = entry_bytes(h)
        if size + n > budget and runs[-1]:
            runs.append([])
            size = 0
        runs[-1].append(h)
        size += n
    return runs
