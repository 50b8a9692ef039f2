"""The global KV index behind kvmeta: block hash -> instances holding it, per-instance inventories.

Block hashes are chained (block i's hash covers every token up to the end of block i), so an
instance's prefix match is the number of leading prompt blocks it holds. ``match_prefix`` walks the
prompt's blocks once, narrowing the set of instances still matching: time linear in the number of
prompt blocks (times the instances still in the running).

Each instance's events carry a sequence number; a gap (or an unknown instance) means events were lost,
and the index asks for the full inventory instead of guessing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    """Prefix match lengths, in blocks."""

    prefix_blocks: dict[str, int]  # instance -> leading blocks it holds (only instances with >= 1)
    best_blocks: int
    best_instance: str


class KVIndex:
    """Which instance holds which block."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = defaultdict(set)
        self._inventory: dict[str, set[bytes]] = {}
        self._seq: dict[str, int] = {}

    def apply(
        self, instance: str, seq: int, stored: Iterable[bytes], removed: Iterable[bytes], full: bool = False
    ) -> bool:
        """Apply one event batch; returns True when the instance must resend its full inventory."""
        if full:
            self.drop_instance(instance)
            self._inventory[instance] = set()
        elif self._seq.get(instance) != seq - 1:
            return True
        self._seq[instance] = seq
        inventory = self._inventory[instance]
        for h in removed:
            inventory.discard(h)
            self._discard(h, instance)
        for h in stored:
            inventory.add(h)
            self._holders[h].add(instance)
        return False

    def drop_instance(self, instance: str) -> int:
        """Forget every block of an instance (its lease is gone); returns how many."""
        inventory = self._inventory.pop(instance, set())
        self._seq.pop(instance, None)
        for h in inventory:
            self._discard(h, instance)
        return len(inventory)

    def _discard(self, h: bytes, instance: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._holders[h]

    def num_blocks(self, instance: str) -> int:
        """Blocks indexed for an instance."""
        return len(self._inventory.get(instance, ()))

    def instances(self) -> list[str]:
        """Instances with an inventory."""
        return sorted(self._inventory)

    def match_prefix(self, block_hashes: Sequence[bytes], instances: Iterable[str] = ()) -> PrefixMatch:
        """Each instance's count of leading blocks held, and the best one."""
        wanted = set(instances)
        alive = set(self._holders.get(block_hashes[0], ())) if block_hashes else set()
        if wanted:
            alive &= wanted
        matched: dict[str, int] = {}
        empty: set[str] = set()
        for i, h in enumerate(block_hashes):
            dropped = alive - self._holders.get(h, empty)
            if dropped:
                matched.update(dict.fromkeys(dropped, i))
                alive -= dropped
            if not alive:
                break
        for instance in alive:
            matched[instance] = len(block_hashes)
        best = max(matched.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
        return PrefixMatch(matched, best[1], best[0])
