"""The global KV index behind kvmeta: block hash -> instances holding it, per-instance inventories.

Block hashes are chained (block i's hash covers every token up to the end of block i), so an
instance's prefix match is the number of leading prompt blocks it holds. ``match_prefix`` walks the
prompt's blocks once, narrowing the set of instances still matching. Holder sets are interned
(blocks held by the same instances share one frozenset), so a block whose holders are the previous
block's costs one identity test: a 100k-token prompt is 6,250 blocks, and along a shared prefix the
holders rarely change. Applying an event pays for that instead (a new set per holder change).

Each instance's events carry a sequence number; a gap (or an unknown instance) means events were lost,
and the index asks for the full inventory instead of guessing. The Mooncake Store is indexed as one
more holder (the store service's instance id) whose entries come from every worker that puts blocks
into it or finds them gone, so they carry no sequence (``update``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

EMPTY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PrefixMatch:
    """Prefix match lengths, in blocks."""

    prefix_blocks: dict[str, int]  # instance -> leading blocks it holds (only instances with >= 1)
    best_blocks: int
    best_instance: str


class KVIndex:
    """Which instance holds which block."""

    def __init__(self) -> None:
        self._holders: dict[bytes, frozenset[str]] = {}  # every value interned in _sets
        self._sets: dict[frozenset[str], list[Any]] = {}  # holder set -> [the shared object, blocks using it]
        self._inventory: dict[str, set[bytes]] = {}
        self._seq: dict[str, int] = {}

    def apply(
        self, instance: str, seq: int, stored: Iterable[bytes], removed: Iterable[bytes], full: bool = False
    ) -> bool:
        """Apply one event batch; returns True when the instance must resend its full inventory."""
        if full:
            self.replace(instance, seq, set(stored).difference(removed))
            return False
        if self._seq.get(instance) != seq - 1:
            return True
        self._seq[instance] = seq
        self.update(instance, stored, removed)
        return False

    def replace(self, instance: str, seq: int, inventory: set[bytes]) -> None:
        """Make ``inventory`` the instance's whole inventory as of ``seq`` (a full resync).

        Only the difference is applied: blocks held before and after keep their entries throughout, so a
        prefix match never sees the instance lose blocks it still holds.
        """
        held = self._inventory.setdefault(instance, set())
        self.update(instance, inventory - held, held - inventory)
        self._seq[instance] = seq

    def update(self, instance: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply a delta that carries no sequence number (the Store's entries: a set with many writers)."""
        inventory = self._inventory.setdefault(instance, set())
        one = frozenset((instance,))
        for h in removed:
            if h in inventory:
                inventory.discard(h)
                self._set(h, self._holders[h] - one)
        for h in stored:
            if h not in inventory:
                inventory.add(h)
                self._set(h, self._holders.get(h, EMPTY) | one)

    def drop_instance(self, instance: str) -> int:
        """Forget every block of an instance (its lease is gone); returns how many."""
        inventory = self._inventory.pop(instance, set())
        self._seq.pop(instance, None)
        one = frozenset((instance,))
        for h in inventory:
            self._set(h, self._holders[h] - one)
        return len(inventory)

    def _set(self, h: bytes, holders: frozenset[str]) -> None:
        """Point ``h`` at the interned copy of ``holders`` (none: forget ``h``) and release its old set."""
        old = self._holders.pop(h, None)
        if old is not None:
            entry = self._sets[old]
            entry[1] -= 1
            if not entry[1]:
                del self._sets[old]
        if holders:
            entry = self._sets.setdefault(holders, [holders, 0])
            entry[1] += 1
            self._holders[h] = entry[0]

    def num_blocks(self, instance: str) -> int:
        """Blocks indexed for an instance."""
        return len(self._inventory.get(instance, ()))

    def instances(self) -> list[str]:
        """Instances with an inventory."""
        return sorted(self._inventory)

    def match_prefix(self, block_hashes: Sequence[bytes], instances: Iterable[str] = ()) -> PrefixMatch:
        """Each instance's count of leading blocks held, and the best one."""
        wanted = set(instances)
        current = self._holders.get(block_hashes[0], EMPTY) if block_hashes else EMPTY
        alive = set(current) & wanted if wanted else set(current)
        if not alive:
            return PrefixMatch({}, 0, "")
        matched: dict[str, int] = {}
        holders_of = self._holders.get
        for i, h in enumerate(block_hashes):
            holders = holders_of(h, EMPTY)
            if holders is current:  # interned: the same instances as the block before, nobody dropped
                continue
            current = holders
            dropped = alive - holders
            if dropped:
                matched.update(dict.fromkeys(dropped, i))
                alive -= dropped
                if not alive:
                    break
        for instance in alive:
            matched[instance] = len(block_hashes)
        best = max(matched.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
        return PrefixMatch(matched, best[1], best[0])
