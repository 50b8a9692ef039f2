"""BlockManager: allocation of KV blocks with prefix caching (after nano-vllm and vLLM v1).

Invariants:
- a block is either referenced (``ref_count > 0``) or in the free list, never both;
- the free list is an LRU: ``allocate`` takes from its head; a freed block that
  carries a hash goes to the tail and stays reusable through ``match_prefix``
  until it is evicted, a freed block without a hash goes to the head;
- ``num_free_blocks`` is exactly what ``allocate`` can hand out now (evictable
  cached blocks included);
- a hash maps to at most one block, and a hit also compares the stored token ids
  (a guard against collisions).
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class StoredBlock(NamedTuple):
    """A KV event: a block entered the prefix cache (what vLLM's ``BlockStored`` says of one block)."""

    block_hash: bytes  # chained: it covers every token up to the end of this block
    parent_hash: bytes | None  # the previous block's hash; None for a prompt's first block
    token_ids: tuple[int, ...]  # the block's own tokens


@dataclass
class _Block:
    """Bookkeeping of one KV block."""

    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Reference-counted KV blocks, a hash -> block map and the KV events it produced."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        """Start with every block free and uncached."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Net changes since the last pop_events (a hash stored then removed cancels out).
        self._stored: dict[bytes, StoredBlock] = {}
        self._removed: dict[bytes, None] = {}
        self.num_hit_tokens = 0
        self.num_miss_tokens = 0

    @property
    def num_blocks(self) -> int:
        """Total number of blocks."""
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now, evictable cached blocks included."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of a block."""
        return self._blocks[block_id].ref_count

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks (evicting cached ones, LRU first), or None if there are not enough."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            return None
        ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in ids:
            self._evict(block_id)
            self._blocks[block_id].ref_count = 1
        return ids

    def match_prefix(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Return the cached blocks of the longest matching prefix and take a reference on each.

        ``token_ids`` must cover the hashed blocks; they are compared with the tokens stored
        with each block, so a hash collision is a miss, never wrong KV.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i, block_hash in enumerate(block_hashes):
            block_id = self._cached.get(block_hash)
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        for block_id in hits:
            if self._blocks[block_id].ref_count == 0:
                del self._free[block_id]
            self._blocks[block_id].ref_count += 1
        return hits

    def record_prefix_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count an admitted request's prompt tokens as cache hits or misses."""
        self.num_hit_tokens += num_cached_tokens
        self.num_miss_tokens += num_prompt_tokens - num_cached_tokens

    def commit_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        parent_hash: bytes | None = None,
    ) -> None:
        """Register blocks ``start..len(block_hashes)-1`` (block i holds ``token_ids[i*bs:(i+1)*bs]``).

        ``parent_hash`` is the hash of the block before ``block_hashes[0]`` (None: that is a prompt's first
        block). A hash already cached in another block keeps that block; this one stays uncached.
        """
        if not self.enable_prefix_caching:
            return
        bs, cached, stored, removed = self.block_size, self._cached, self._stored, self._removed
        blocks = zip(*[iter(token_ids[start * bs : len(block_hashes) * bs])] * bs, strict=True)  # each block's, in C
        parent = block_hashes[start - 1] if start > 0 else parent_hash
        for i, (block_hash, tokens) in enumerate(zip(block_hashes[start:], blocks, strict=True), start):
            block_id = block_ids[i]
            block = self._blocks[block_id]
            if block_hash not in cached and block.block_hash is None:
                block.block_hash, block.token_ids = block_hash, tokens
                cached[block_hash] = block_id
                if block_hash in removed:
                    del removed[block_hash]
                else:
                    stored[block_hash] = StoredBlock(block_hash, parent, tokens)
            parent = block_hash

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, tail first, so a request's last blocks are evicted first."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def pop_events(self) -> tuple[list[StoredBlock], list[bytes]]:
        """Return and clear (blocks stored, in the order cached; hashes removed) since the last call."""
        events = (list(self._stored.values()), list(self._removed))
        self._stored.clear()
        self._removed.clear()
        return events

    def _evict(self, block_id: int) -> None:
        """Forget a block's hash before it is reused."""
        block = self._blocks[block_id]
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        if block.block_hash in self._stored:
            del self._stored[block.block_hash]
        else:
            self._removed[block.block_hash] = None
        block.block_hash, block.token_ids = None, ()
