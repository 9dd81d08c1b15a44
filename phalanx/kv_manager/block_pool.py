"""Block ids, their reference counts, the free list and the LRU of evictable cached blocks.

Pure Python: no torch. The pool knows nothing about tokens or the tree; it only counts.

Every block id in ``range(num_blocks)`` is in exactly one of these states::

    state          ref_count   in tree   where it is tracked
    free           0           no        the free list
    cached         0           yes       counted in num_cached_unreferenced; if it is also a
                                         tree leaf it sits in the LRU (evictable)
    referenced     >= 1        yes/no    held by one or more requests

The tree tells the pool which cached blocks are leaves (``add_evictable`` /
``discard_evictable``); the pool hands them back in eviction order: lowest retention priority
first, least recently used within a priority.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free or evictable."""


class BlockPool:
    """Reference counts, the free list and the eviction LRU over ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.cached: list[bool] = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.num_cached_unreferenced = 0
        # Evictable leaves: block -> (priority, tick); the heap holds (priority, tick, block)
        # entries that are stale when they no longer equal the dict's value (lazy deletion).
        self._evictable: dict[int, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._tick = 0

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (not cached, not referenced)."""
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can obtain: free ones plus every unreferenced cached one.

        Every unreferenced cached block can be evicted, because a referenced tree node always
        has referenced ancestors: unreferenced nodes form whole subtrees, evictable leaf-first.
        """
        return len(self._free) + self.num_cached_unreferenced

    @property
    def num_evictable(self) -> int:
        """Unreferenced cached leaves, ready to be evicted now."""
        return len(self._evictable)

    def next_tick(self) -> int:
        """A monotonically increasing access time."""
        self._tick += 1
        return self._tick

    # -- free list --------------------------------------------------------------------------
    def take_free(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the free list with ref count 1. Raises if fewer are free."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} free blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def put_free(self, block_id: int) -> None:
        """Return an unreferenced, uncached block to the free list."""
        assert self.ref_counts[block_id] == 0 and not self.cached[block_id], block_id
        self._free.append(block_id)

    # -- references -------------------------------------------------------------------------
    def ref(self, block_id: int) -> None:
        """Add a holder. A cached block leaving ref 0 stops being evictable."""
        self.ref_all((block_id,))

    def ref_all(self, block_ids: Sequence[int]) -> None:
        """``ref`` each block in turn (a request taking a matched prefix of many blocks: one call,
        not one a block)."""
        refs, cached, evictable = self.ref_counts, self.cached, self._evictable
        for b in block_ids:
            if refs[b] == 0 and cached[b]:
                self.num_cached_unreferenced -= 1
                evictable.pop(b, None)   # ``discard_evictable``
            refs[b] += 1

    def unref(self, block_id: int) -> int:
        """Drop a holder and return the new count.

        At zero an uncached block goes back to the free list; a cached one is counted as
        cached-unreferenced (the caller, who knows the tree, decides whether it is a leaf).
        """
        count = self.ref_counts[block_id] - 1
        if count < 0:
            raise RuntimeError(f"block {block_id} released more often than it was taken")
        self.ref_counts[block_id] = count
        if count == 0:
            if self.cached[block_id]:
                self.num_cached_unreferenced += 1
            else:
                self._free.append(block_id)
        return count

    # -- cached state (set by the tree) -----------------------------------------------------
    def set_cached(self, block_id: int, cached: bool) -> None:
        """Mark a block as held by the tree (on insert) or not (on evict)."""
        if self.cached[block_id] == cached:
            return
        self.cached[block_id] = cached
        if self.ref_counts[block_id] == 0:
            self.num_cached_unreferenced += 1 if cached else -1

    # -- eviction LRU -----------------------------------------------------------------------
    def add_evictable(self, block_id: int, priority: int, tick: int) -> None:
        """Offer an unreferenced cached leaf for eviction."""
        entry = (priority, tick)
        self._evictable[block_id] = entry
        heapq.heappush(self._heap, (priority, tick, block_id))

    def discard_evictable(self, block_id: int) -> None:
        """Withdraw a block from eviction (it got a holder or a child)."""
        self._evictable.pop(block_id, None)

    def pop_evictable(self) -> int:
        """Remove and return the next block to evict: lowest priority, then oldest tick."""
        while self._heap:
            priority, tick, block_id = heapq.heappop(self._heap)
            if self._evictable.get(block_id) == (priority, tick):
                del self._evictable[block_id]
                return block_id
        raise NoFreeBlocksError("no evictable block")

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks in eviction order (for inspection and tests)."""
        return [b for _, _, b in sorted((p, t, b) for b, (p, t) in self._evictable.items())]
