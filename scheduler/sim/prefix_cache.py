"""One instance's prefix cache: chained block hashes in LRU order, of limited capacity.

A prefill stores the prompt's full blocks (reused and copied ones are touched, new ones added); when
the cache is over capacity the least recently used blocks go. Every change is reported as a KV event
batch (stored, removed) with a per-instance sequence number, the same event stream a live worker sends
to kvmeta, so the global ``KVIndex`` the policy reads is fed exactly as in the live system.

Trace blocks are 512 tokens; a live engine's KV blocks are smaller (``cache_block_tokens``, 16 by default
in the config). A prompt that ends inside a trace block leaves that block's first whole engine blocks
cached, and a later prompt continuing the same block reuses them live; so does a prompt that ends inside
a block another prompt cached whole. The cache keeps such partly cached trace blocks (``tails``: tokens
held), counts each as a block of its capacity, and ``match_tokens`` adds what they give. The index the
policy reads holds whole trace blocks only (the simulated Conductor does not see the tails).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from scheduler.kv_index import KVIndex


class PrefixCache:
    """LRU set of block hashes that mirrors itself into a ``KVIndex``."""

    def __init__(self, instance_id: str, capacity_blocks: int, index: KVIndex, cache_block_tokens: int = 0) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"prefix cache capacity must be at least one block, got {capacity_blocks}")
        self.instance_id = instance_id
        self.capacity_blocks = capacity_blocks
        self.index = index
        self.cache_block_tokens = cache_block_tokens  # engine block: the grain of partial reuse (0: whole blocks)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._tails: OrderedDict[bytes, int] = OrderedDict()  # partly cached trace blocks: tokens held
        self._seq = 0
        self.evicted = 0
        index.apply(instance_id, 0, (), (), full=True)

    def __len__(self) -> int:
        return len(self._blocks) + len(self._tails)

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` held here (no LRU touch)."""
        blocks = self._blocks
        for i, h in enumerate(block_hashes):
            if h not in blocks:
                return i
        return len(block_hashes)

    def match_tokens(self, block_hashes: Sequence[bytes], num_tokens: int, block_size: int) -> int:
        """Leading tokens of a ``num_tokens`` prompt held here (no LRU touch).

        Its whole ``block_size`` blocks, then what the cache holds of the next one (a tail, or a whole
        block the prompt ends inside), in engine blocks.
        """
        full = self.match(block_hashes[: num_tokens // block_size])
        matched = full * block_size
        if not self.cache_block_tokens or full == len(block_hashes):
            return matched
        h = block_hashes[full]
        held = block_size if h in self._blocks else self._tails.get(h, 0)
        part = min(held, num_tokens - matched)
        return matched + part // self.cache_block_tokens * self.cache_block_tokens

    def store(self, block_hashes: Sequence[bytes], tail: tuple[bytes, int] | None = None) -> None:
        """Touch or add a prompt's full blocks, evict over capacity, and publish the change (whole blocks).

        ``tail``: the block the prompt ends inside and its tokens there, kept in engine blocks.
        """
        blocks, tails = self._blocks, self._tails
        stored: list[bytes] = []
        for h in block_hashes:
            tails.pop(h, None)
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        if tail is not None and self.cache_block_tokens and tail[0] not in blocks:
            tokens = tail[1] // self.cache_block_tokens * self.cache_block_tokens
            if tokens:
                tails[tail[0]] = max(tokens, tails.pop(tail[0], 0))
        removed: list[bytes] = []
        while tails and len(blocks) + len(tails) > self.capacity_blocks:
            tails.popitem(last=False)  # a partial block goes before any whole one (never in the index)
        while len(blocks) > self.capacity_blocks:
            removed.append(blocks.popitem(last=False)[0])
        self.evicted += len(removed)
        if removed and len(stored) > self.capacity_blocks:
            stored = [h for h in stored if h in blocks]  # a prompt larger than the cache: keep the index exact
        if stored or removed:
            self._seq += 1
            if self.index.apply(self.instance_id, self._seq, stored, removed):
                raise RuntimeError(f"KV index lost events of {self.instance_id}")  # cannot happen in-process
