"""The global KV index behind kvmeta: block hash -> the instances holding it.

Block hashes are chained (block i's hash covers every token up to the end of block i), so an
instance's prefix match is the number of leading prompt blocks it holds. ``match_prefix`` walks the
prompt's blocks once, narrowing the set of instances still matching. Holder sets are interned
(blocks held by the same instances share one sorted tuple), so a block whose holders are the previous
block's costs one identity test: a 100k-token prompt is 6,250 blocks, and along a shared prefix the
holders rarely change. Applying an event pays for that instead (a new tuple per holder change).

The index is one dict of bytes -> tuples of strings, and nothing else per block: Python's garbage
collector stops tracking such a dict, so however many blocks the index holds, a collection does not walk
them (a set of hashes per instance cost a 20 ms pause per full collection at 400k blocks, in kvmeta and in
every Conductor's replica). What needs an instance's blocks (an instance leaving, a full resync, a
follower's snapshot) scans the dict instead: rare events, not requests.

Each instance's events carry a sequence number; a gap (or an unknown instance) means events were lost,
and the index asks for the full inventory instead of guessing. The Mooncake Store is indexed as one
more holder (the store service's instance id) whose entries come from every worker that puts blocks
into it or finds them gone, so they carry no sequence (``update``).

A ``follower`` callback, when set, hears every change as applied (blocks an instance gained and lost, or
that it left): kvmeta streams them to the Conductors, whose replicas of this index match prompts in their
own process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler._prefix_runs import prefix_runs

Holders = tuple[str, ...]  # sorted instance ids, interned
EMPTY: Holders = ()
# (instance, blocks it gained, blocks it lost, whether it left and every block of it went)
Follower = Callable[[str, list[bytes], list[bytes], bool], None]


@dataclass(frozen=True)
class PrefixMatch:
    """Prefix match lengths, in blocks."""

    prefix_blocks: dict[str, int]  # instance -> leading blocks it holds (only instances with >= 1)
    best_blocks: int
    best_instance: str


class KVIndex:
    """Which instance holds which block."""

    def __init__(self) -> None:
        self._holders: dict[bytes, Holders] = {}  # every value interned in _sets
        self._sets: dict[Holders, list[Any]] = {}  # holders -> [the shared tuple, blocks using it]
        self._counts: Counter[str] = Counter()  # instance -> blocks it holds
        self._seq: dict[str, int] = {}
        self.follower: Follower | None = None

    def apply(
        self, instance: str, seq: int, stored: Iterable[bytes], removed: Iterable[bytes], full: bool = False
    ) -> bool:
        """Apply one event batch; returns True when the instance must resend its full inventory.

        A batch numbered at or below the last one applied is in already: an instance sends a batch again when
        its call timed out, not knowing whether it arrived (services/worker/kv/events.py).
        """
        if full:
            self.replace(instance, seq, set(stored).difference(removed))
            return False
        last = self._seq.get(instance)
        if last is not None and seq <= last:
            return False
        if last != seq - 1:
            return True
        self._seq[instance] = seq
        self.update(instance, stored, removed)
        return False

    def replace(self, instance: str, seq: int, inventory: set[bytes]) -> None:
        """Make ``inventory`` the instance's whole inventory as of ``seq`` (a full resync).

        Only the difference is applied: blocks held before and after keep their entries throughout, so a
        prefix match never sees the instance lose blocks it still holds.
        """
        held = set(self.blocks(instance)) if self._counts[instance] else set()
        self.update(instance, inventory - held, held - inventory)
        self._seq[instance] = seq

    def update(self, instance: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply a delta that carries no sequence number (the Store's entries: a set with many writers)."""
        holders_of = self._holders.get
        gained: list[bytes] = []
        lost: list[bytes] = []
        for h in removed:
            old = holders_of(h, EMPTY)
            if instance in old:
                self._set(h, tuple(i for i in old if i != instance))
                lost.append(h)
        for h in stored:
            old = holders_of(h, EMPTY)
            if instance not in old:
                self._set(h, tuple(sorted((*old, instance))))
                gained.append(h)
        self._counts[instance] += len(gained) - len(lost)
        if self.follower is not None and (gained or lost):
            self.follower(instance, gained, lost, False)

    def drop_instance(self, instance: str) -> int:
        """Forget every block of an instance (its lease is gone); returns how many."""
        self._seq.pop(instance, None)
        held = self._counts.pop(instance, 0)
        if not held:
            return 0
        for h in self.blocks(instance):
            self._set(h, tuple(i for i in self._holders[h] if i != instance))
        if self.follower is not None:
            self.follower(instance, [], [], True)
        return held

    def _set(self, h: bytes, holders: Holders) -> None:
        """Point ``h`` at the interned copy of ``holders`` (none: forget ``h``) and release its old tuple."""
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

    def blocks(self, instance: str) -> list[bytes]:
        """The blocks an instance holds (a scan of the whole index)."""
        interned = {id(held) for held in self._sets if instance in held}  # the keys are the interned tuples
        if not interned:
            return []
        return [h for h, held in self._holders.items() if id(held) in interned]

    def num_blocks(self, instance: str) -> int:
        """Blocks indexed for an instance."""
        return self._counts.get(instance, 0)

    def inventories(self) -> list[tuple[str, list[bytes]]]:
        """Every instance's blocks (a snapshot for a follower; one scan of the index)."""
        blocks: dict[str, list[bytes]] = {instance: [] for instance in self.instances()}
        for h, held in self._holders.items():
            for instance in held:
                blocks[instance].append(h)
        return list(blocks.items())

    def instances(self) -> list[str]:
        """Instances holding blocks."""
        return sorted(instance for instance, n in self._counts.items() if n)

    def match_prefix(self, block_hashes: Sequence[bytes], instances: Iterable[str] = ()) -> PrefixMatch:
        """Each instance's count of leading blocks held, and the best one.

        The walk is ``prefix_runs`` (C): the positions where a block's holders differ from the block before's
        (interned: an identity test), up to the first block nobody holds; only those are looked at here.
        """
        wanted = set(instances)
        first = self._holders.get(block_hashes[0], EMPTY) if block_hashes else EMPTY
        alive = set(first) & wanted if wanted else set(first)
        if not alive:
            return PrefixMatch({}, 0, "")
        matched: dict[str, int] = {}
        for i, holders in prefix_runs(self._holders, block_hashes):
            dropped = alive.difference(holders or EMPTY)
            if dropped:
                matched.update(dict.fromkeys(dropped, i))
                alive -= dropped
                if not alive:
                    break
        for instance in alive:
            matched[instance] = len(block_hashes)
        best = max(matched.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
        return PrefixMatch(matched, best[1], best[0])
