"""One instance's prefix cache: chained block hashes in LRU order, of limited capacity.

A prefill stores the prompt's full blocks (reused and copied ones are touched, new ones added); when
the cache is over capacity the least recently used blocks go. Every change is reported as a KV event
batch (stored, removed) with a per-instance sequence number, the same event stream a live worker sends
to kvmeta, so the global ``KVIndex`` the policy reads is fed exactly as in the live system.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from scheduler.kv_index import KVIndex


class PrefixCache:
    """LRU set of block hashes that mirrors itself into a ``KVIndex``."""

    def __init__(self, instance_id: str, capacity_blocks: int, index: KVIndex) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"prefix cache capacity must be at least one block, got {capacity_blocks}")
        self.instance_id = instance_id
        self.capacity_blocks = capacity_blocks
        self.index = index
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._seq = 0
        self.evicted = 0
        index.apply(instance_id, 0, (), (), full=True)

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` held here (no LRU touch)."""
        blocks = self._blocks
        for i, h in enumerate(block_hashes):
            if h not in blocks:
                return i
        return len(block_hashes)

    def store(self, block_hashes: Sequence[bytes]) -> None:
        """Touch or add a prompt's full blocks, evict over capacity, and publish the change."""
        blocks = self._blocks
        stored: list[bytes] = []
        for h in block_hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        removed: list[bytes] = []
        while len(blocks) > self.capacity_blocks:
            removed.append(blocks.popitem(last=False)[0])
        self.evicted += len(removed)
        if removed and len(stored) > self.capacity_blocks:
            stored = [h for h in stored if h in blocks]  # a prompt larger than the cache: keep the index exact
        if stored or removed:
            self._seq += 1
            if self.index.apply(self.instance_id, self._seq, stored, removed):
                raise RuntimeError(f"KV index lost events of {self.instance_id}")  # cannot happen in-process
