"""Full inventories that arrive in chunks: added to the index as they come, swept at the last chunk.

A worker's full inventory can exceed gRPC's 4 MiB message limit (190,464 blocks are 6.2 MiB), so it
comes as ``num_chunks`` messages, ``chunk_index`` 0 .. ``num_chunks - 1``, back to back under one
sequence number (the resync's). Invariants:

* While a resync is under way the instance's entries are a superset of what they were before it: each
  chunk's blocks are added at once (they are held: the inventory is a snapshot taken when the resync
  began), nothing is removed. At the last chunk the blocks the resync did not name are removed and the
  resync's seq becomes the instance's, so the entries are exactly the inventory. A resync that never
  completes therefore never leaves the index worse than before, and adding as chunks come spreads the
  work (about 60 ms a chunk of 30,840 blocks) instead of stalling kvmeta's loop for the whole inventory.
* At most one resync is staged per instance; chunk 0 always starts a new one (a worker that started
  over, or a new process under the same id, replaces what was staged).
* A chunk is accepted only if it continues the staged resync: same seq, same ``num_chunks``, the next
  index. Anything else (kvmeta restarted mid-way and has nothing staged, a chunk was lost) drops the
  staging and raises ``ChunkGap``: the worker starts over at chunk 0.
* Staging holds the hashes received so far, until the last chunk or ``discard`` (the instance left, or
  sent anything else).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.kv_index import KVIndex


class ChunkGap(Exception):
    """A chunk that does not continue the resync staged for its instance."""


@dataclass
class _Staged:
    seq: int
    num_chunks: int
    next_index: int = 0
    hashes: set[bytes] = field(default_factory=set)  # every block named so far


class ChunkedResyncs:
    """The chunked full inventories being received into ``index``, one per instance at most."""

    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._staged: dict[str, _Staged] = {}

    def add(self, instance: str, seq: int, chunk_index: int, num_chunks: int, hashes: Sequence[bytes]) -> bool:
        """Apply one chunk; True when it was the last (the instance's entries are now exactly its inventory).

        Raises ``ChunkGap`` when the chunk does not continue the staged resync, ``ValueError`` when the
        chunk's numbering is impossible.
        """
        if not 0 <= chunk_index < num_chunks:
            raise ValueError(f"chunk_index {chunk_index} is not below num_chunks {num_chunks}")
        if chunk_index == 0:
            self._staged[instance] = _Staged(seq, num_chunks)
        staged = self._staged.get(instance)
        if staged is None or (staged.seq, staged.num_chunks, staged.next_index) != (seq, num_chunks, chunk_index):
            self._staged.pop(instance, None)
            expected = "nothing staged" if staged is None else f"chunk {staged.next_index} of seq {staged.seq}"
            raise ChunkGap(f"chunk {chunk_index}/{num_chunks} of seq {seq} from {instance}, expected {expected}")
        staged.hashes.update(hashes)
        self.index.update(instance, hashes, ())
        staged.next_index += 1
        if staged.next_index < num_chunks:
            return False
        del self._staged[instance]
        self.index.replace(instance, seq, staged.hashes)  # every block is in: this only removes the rest
        return True

    def discard(self, instance: str) -> None:
        """Forget the instance's staged resync, if any (its entries stay as they are)."""
        self._staged.pop(instance, None)

    def staged(self) -> list[str]:
        """Instances with a resync under way."""
        return sorted(self._staged)
