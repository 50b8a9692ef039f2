import pytest

from engine.block_hash import prefix_block_hashes
from engine.block_manager import BlockManager, StoredBlock

BS = 4


def commit(manager: BlockManager, blocks: list[int], tokens: list[int]) -> list[bytes]:
    hashes = prefix_block_hashes(tokens, BS)
    manager.commit_full_blocks(blocks, hashes, tokens, 0)
    return hashes


def hashes_of(events: tuple[list[StoredBlock], list[bytes]]) -> tuple[list[bytes], list[bytes]]:
    """(hashes stored, hashes removed) of ``pop_events``."""
    return [b.block_hash for b in events[0]], events[1]


def test_allocation_accounting_is_exact_and_never_partial() -> None:
    manager = BlockManager(8, BS)
    a = manager.allocate(5)
    assert a is not None and len(set(a)) == 5 and manager.num_free_blocks == 3
    assert manager.allocate(4) is None and manager.num_free_blocks == 3
    manager.free(a)
    assert manager.num_free_blocks == 8
    with pytest.raises(ValueError, match="freed more times"):
        manager.free(a[:1])


def test_cached_blocks_count_as_free_and_are_reused_by_match() -> None:
    manager = BlockManager(4, BS)
    tokens = list(range(8))
    blocks = manager.allocate(2)
    assert blocks is not None
    hashes = commit(manager, blocks, tokens)
    manager.free(blocks)
    assert manager.num_free_blocks == 4
    hits = manager.match_prefix(hashes, tokens)
    assert hits == blocks and manager.num_free_blocks == 2
    assert [manager.ref_count(b) for b in hits] == [1, 1]
    again = manager.match_prefix(hashes, tokens)
    assert again == blocks and [manager.ref_count(b) for b in hits] == [2, 2]


def test_partial_prefix_match_stops_at_first_miss() -> None:
    manager = BlockManager(4, BS)
    blocks = manager.allocate(2)
    assert blocks is not None
    commit(manager, blocks, list(range(8)))
    other = list(range(4)) + [99, 98, 97, 96]
    assert manager.match_prefix(prefix_block_hashes(other, BS), other) == blocks[:1]


def test_lru_eviction_order_and_uncached_blocks_first() -> None:
    manager = BlockManager(4, BS)
    old, new = manager.allocate(1), manager.allocate(1)
    scratch = manager.allocate(2)
    assert old is not None and new is not None and scratch is not None
    old_hash = commit(manager, old, [1, 1, 1, 1])
    new_hash = commit(manager, new, [2, 2, 2, 2])
    manager.free(old)
    manager.free(new)
    manager.free(scratch)  # uncached: handed out before any cached block
    assert sorted(manager.allocate(2) or []) == sorted(scratch)
    assert manager.allocate(1) == old  # least recently freed cached block is evicted first
    assert manager.match_prefix(old_hash, [1, 1, 1, 1]) == []
    assert manager.match_prefix(new_hash, [2, 2, 2, 2]) == new


def test_free_is_tail_first() -> None:
    manager = BlockManager(3, BS)
    blocks = manager.allocate(3)
    assert blocks is not None
    commit(manager, blocks, list(range(12)))
    manager.free(blocks)
    assert manager.allocate(1) == [blocks[-1]]  # the tail is evicted first, the shared prefix survives


def test_collision_guard_compares_token_ids() -> None:
    manager = BlockManager(2, BS)
    blocks = manager.allocate(1)
    assert blocks is not None
    hashes = commit(manager, blocks, [5, 6, 7, 8])
    assert manager.match_prefix(hashes, [5, 6, 7, 9]) == []  # same hash, other tokens: a miss


def test_duplicate_content_keeps_first_block() -> None:
    manager = BlockManager(2, BS)
    a, b = manager.allocate(1), manager.allocate(1)
    assert a is not None and b is not None
    hashes = commit(manager, a, [1, 2, 3, 4])
    commit(manager, b, [1, 2, 3, 4])
    assert manager.match_prefix(hashes, [1, 2, 3, 4]) == a
    assert hashes_of(manager.pop_events()) == (hashes, [])


def test_events_report_net_changes() -> None:
    manager = BlockManager(1, BS)
    blocks = manager.allocate(1)
    assert blocks is not None
    first = commit(manager, blocks, [1, 2, 3, 4])
    assert hashes_of(manager.pop_events()) == (first, [])
    manager.free(blocks)
    reused = manager.allocate(1)  # evicts `first`
    assert reused is not None
    second = commit(manager, reused, [5, 6, 7, 8])
    assert hashes_of(manager.pop_events()) == (second, first)
    assert hashes_of(manager.pop_events()) == ([], [])
    manager.free(reused)
    third = manager.allocate(1)
    assert third is not None
    commit(manager, third, [5, 6, 7, 8])  # evicted and stored again: nothing changed net
    assert hashes_of(manager.pop_events()) == ([], [])


def test_a_stored_block_names_its_parent_and_its_own_tokens() -> None:
    manager = BlockManager(4, BS)
    blocks = manager.allocate(3)
    assert blocks is not None
    tokens = list(range(12))
    hashes = commit(manager, blocks[:2], tokens[:8])
    stored, _ = manager.pop_events()
    assert stored == [StoredBlock(hashes[0], None, (0, 1, 2, 3)), StoredBlock(hashes[1], hashes[0], (4, 5, 6, 7))]
    later = prefix_block_hashes(tokens, BS)[2:]  # a block imported after two held ones: its parent is given
    manager.commit_full_blocks(blocks[2:], later, tokens[8:], 0, parent_hash=hashes[1])
    assert manager.pop_events()[0] == [StoredBlock(later[0], hashes[1], (8, 9, 10, 11))]


def test_prefix_caching_disabled() -> None:
    manager = BlockManager(2, BS, enable_prefix_caching=False)
    blocks = manager.allocate(1)
    assert blocks is not None
    hashes = commit(manager, blocks, [1, 2, 3, 4])
    manager.free(blocks)
    assert manager.match_prefix(hashes, [1, 2, 3, 4]) == []
    assert hashes_of(manager.pop_events()) == ([], [])


def test_hit_and_miss_counters() -> None:
    manager = BlockManager(2, BS)
    manager.record_prefix_lookup(10, 4)
    assert (manager.num_hit_tokens, manager.num_miss_tokens) == (4, 6)
