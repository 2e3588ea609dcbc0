"""KV memory pressure: how many blocks work needs, and making room (torch-free).

Eviction never loses information, only computed KV: a context whose blocks
are dropped keeps its tokens, its ``computed_len`` goes down accordingly, and
the engine recomputes the missing KV before the context is used again (a
fill or generate on it, or a fork from it).  Freeing is by reference count,
so dropping one context's references never touches KV another context still
reads.

:meth:`MemoryManager.make_room` takes from contexts the caller does not
exclude (the runner excludes the contexts of running jobs; preempting those
is the runner's decision), least recently used first, idle contexts before
preempted ones, and of idle ones those not *retained* first (a retained
context holds a prompt prefix the manager computed for a call that has not
run yet: :mod:`parrot.manager.early_prefill`; a finished application's KV
goes before it):
1. private suffixes (blocks only that context references) — freed at once;
2. then whole block tables, but only of contexts holding some block that no
   excluded context references (dropping the others would free nothing).
It evicts nothing when even dropping every candidate would not be enough
(unless forced: the runner's last resort for its oldest job, see
:meth:`EngineRunner._make_room`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from parrot.engine.core.contexts import Context, ContextTable


class MemoryManager:
    def __init__(self, contexts: ContextTable, watermark_fraction: float = 0.01):
        self.contexts = contexts
        self.pool = contexts.pool
        self.block_size = contexts.block_size
        # blocks kept free when admitting new work, so running decodes can grow
        self.watermark = max(1, int(self.pool.num_blocks * watermark_fraction))
        self._clock = 0

    def tick(self) -> None:
        self._clock += 1

    def touch(self, ctx: Context) -> None:
        ctx.last_used = self._clock

    def _blocks(self, length: int, table_len: int, computed: int) -> int:
        cow = 1 if computed % self.block_size and length > computed else 0
        return max(0, self.pool.blocks_for(length) - table_len) + cow

    def blocks_to_compute(self, ctx: Context) -> int:
        """Fresh blocks (at most) to compute all of ``ctx``'s pending tokens."""
        return self._blocks(ctx.length, len(ctx.block_table), ctx.computed_len)

    def prospective(self, context_id: int, parent_id: int | None, new_tokens: int) -> tuple[int, int]:
        """(length, fresh blocks needed) of a context after a job appends ``new_tokens``
        to it (creating or forking it if needed)."""
        table = self.contexts
        if context_id in table:
            ctx = table.get(context_id)
            length = ctx.length + new_tokens
            return length, self._blocks(length, len(ctx.block_table), ctx.computed_len)
        if parent_id is not None and parent_id in table:
            parent = table.get(parent_id)
            length = parent.length + new_tokens
            return length, self._blocks(length, self.pool.blocks_for(parent.length), parent.length)
        return new_tokens, self._blocks(new_tokens, 0, 0)

    def drop_private(self, ctx: Context) -> int:
        """Drop ``ctx``'s private suffix; returns the blocks freed."""
        return self.contexts.truncate(ctx, self.contexts.private_from(ctx) * self.block_size)

    def make_room(self, n: int, exclude: Container[int], *, force: bool = False) -> bool:
        """Evict KV of contexts whose id is not in ``exclude`` until ``n`` blocks are
        free; False (and nothing evicted) if that is impossible.  ``force``: go on
        regardless, dropping every candidate's KV if need be (the caller's own need
        may shrink as a result: a copy-on-write it no longer needs)."""
        pool = self.pool
        if pool.num_free >= n:
            return True
        cands = [c for c in self.contexts if c.block_table and c.context_id not in exclude]
        refs = Counter(b for c in cands for b in c.block_table)
        freeable = sum(1 for b, r in refs.items() if pool.refcount(b) == r)
        if pool.num_free + freeable < n and not force:
            return False
        cands.sort(key=lambda c: (c.busy, c.retained, c.last_used))
        for c in cands:
            refs.subtract(c.block_table[self.contexts.private_from(c) :])
            self.drop_private(c)
            if pool.num_free >= n:
                return True
        for c in cands:
            if any(pool.refcount(b) == refs[b] for b in c.block_table):
                refs.subtract(c.block_table)
                self.contexts.truncate(c, 0)
                if pool.num_free >= n:
                    return True
        if force:
            for c in cands:
                self.contexts.truncate(c, 0)
        return pool.num_free >= n
