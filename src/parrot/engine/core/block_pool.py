"""A fixed pool of reference-counted KV blocks (torch-free bookkeeping).

The KV cache is carved into ``num_blocks`` blocks of ``block_size`` token
slots each; the tensors live in :mod:`parrot.engine.kv_store`, this module only
decides which block ids are in use.

Invariants:
- every block id in ``[0, num_blocks)`` is exactly one of *free* (refcount 0,
  on the free list exactly once), *cached* (refcount 0, retained, in the
  least-recently-used order of cached blocks exactly once) or *used*
  (refcount >= 1);
- a *retained* block keeps its content when its last reference goes: it
  becomes cached instead of free (the prefix cache retains the blocks it
  indexes, :mod:`parrot.engine.core.prefix_cache`).  Cached blocks count as
  obtainable: ``num_free`` includes them, and :meth:`allocate` takes free
  blocks first, then evicts cached ones, least recently cached first, telling
  ``on_evict`` so their owner forgets them; :meth:`incref` of a cached block
  makes it used again;
- ``num_free + num_used == num_blocks`` (``num_free`` counting cached blocks);
- at most ``max_cached`` blocks are cached: a release beyond it evicts the least
  recently cached blocks to the free list at once.  Memory is committed by the
  OS when a block is first written, and the free list is a stack whose never
  used blocks lie at the bottom, so the budget keeps the cache from sweeping
  through fresh memory (each first write of a block costs page faults, and with
  huge pages possibly a compaction stall): once the blocks in use plus the
  cache have been touched, allocations reuse touched memory;
- allocation and release are O(1) per block; the free list is a stack, so the
  most recently freed blocks (whose memory is warm) are reused first.

Running out of blocks is control flow, not an error: :meth:`allocate` returns
``None`` and allocates nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

DEFAULT_BLOCK_SIZE = 16


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *, max_cached: int | None = None
    ):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        if max_cached is not None and (isinstance(max_cached, bool) or max_cached < 0):
            raise ValueError(f"max_cached must be a non-negative integer, got {max_cached!r}")
        self.max_cached = num_blocks if max_cached is None else max_cached
        self._retained: set[int] = set()
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently cached first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can obtain: free ones and cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens from position 0."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with refcount 1, or ``None`` (nothing allocated, nothing
        evicted) if fewer are obtainable.  Free blocks go first, then cached ones are
        evicted (least recently cached first; ``on_evict(block)`` is called for each)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        free, refs = self._free, self._refs
        out = [free.pop() for _ in range(min(n, len(free)))]
        while len(out) < n:
            out.append(self._evict_oldest())
        for b in out:
            refs[b] = 1
        return out

    def retain(self, block: int) -> None:
        """Keep ``block``'s content when its last reference goes (it must be used now)."""
        if self._refs[block] <= 0:
            raise ValueError(f"retain of unused block {block}")
        self._retained.add(block)

    def unretain(self, block: int) -> None:
        """Undo :meth:`retain`: a cached block becomes free at once (its owner has
        forgotten it; ``on_evict`` is not called)."""
        self._retained.discard(block)
        if block in self._cached:
            del self._cached[block]
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to each used or cached block (a cached one is used again);
        a block listed twice gains two."""
        refs = self._refs
        for b in blocks:
            if refs[b] <= 0:
                if b not in self._cached:
                    raise ValueError(f"incref of free block {b}")
                del self._cached[b]
            refs[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop a reference from each block; returns the blocks whose last reference
        went (free, or cached if retained).  Of the blocks one call caches, the
        last listed is evicted first: a block table's tail goes before its head."""
        refs, released = self._refs, []
        for b in blocks:
            r = refs[b]
            if r <= 0:
                raise ValueError(f"decref of free block {b}")
            refs[b] = r - 1
            if r == 1:
                released.append(b)
        retained, cached = self._retained, self._cached
        for b in reversed(released):  # the tail enters the eviction order first
            if b in retained:
                cached[b] = None
        # the first freed is reused first
        self._free.extend(b for b in reversed(released) if b not in retained)
        while len(cached) > self.max_cached:  # over budget: the least recently cached go now
            self._free.append(self._evict_oldest())
        return released

    def _evict_oldest(self) -> int:
        """Take the least recently cached block out of the cache (its owner is told)."""
        b, _ = self._cached.popitem(last=False)
        self._retained.discard(b)
        if self.on_evict is not None:
            self.on_evict(b)
        return b
