"""A fixed pool of reference-counted KV blocks (torch-free bookkeeping).

The KV cache is carved into ``num_blocks`` blocks of ``block_size`` token
slots each; the tensors live in :mod:`parrot.engine.kv_store`, this module only
decides which block ids are in use.

Invariants:
- every block id in ``[0, num_blocks)`` is either *free* (refcount 0, on the
  free list exactly once) or *used* (refcount >= 1, not on the free list);
- ``num_free + num_used == num_blocks``;
- allocation and release are O(1) per block; the free list is a stack, so the
  most recently freed blocks (whose memory is warm) are reused first.

Running out of blocks is control flow, not an error: :meth:`allocate` returns
``None`` and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_BLOCK_SIZE = 16


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens from position 0."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with refcount 1, or ``None`` (nothing allocated) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        free, refs = self._free, self._refs
        out = [free.pop() for _ in range(n)]
        for b in out:
            refs[b] = 1
        return out

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to each (used) block; a block listed twice gains two."""
        refs = self._refs
        for b in blocks:
            if refs[b] <= 0:
                raise ValueError(f"incref of free block {b}")
            refs[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop a reference from each block; returns the blocks that became free."""
        refs, freed = self._refs, []
        for b in blocks:
            r = refs[b]
            if r <= 0:
                raise ValueError(f"decref of free block {b}")
            refs[b] = r - 1
            if r == 1:
                freed.append(b)
        self._free.extend(reversed(freed))  # the first freed is reused first
        return freed
