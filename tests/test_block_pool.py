"""The block pool and paged block tables: refcounts, copy-on-write, eviction, exhaustion.

The property test drives a :class:`ContextTable` and a real :class:`PagedKVCache`
through random forks, appends, evictions and frees.  The "KV" written for a
position is its token id, so a context's shadow copy is simply its token list:
after every operation each context's keys, gathered through its block table,
must equal its tokens up to ``computed_len``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from parrot.engine.core.block_pool import BlockPool
from parrot.engine.core.contexts import Context, ContextTable
from parrot.engine.core.memory import MemoryManager
from parrot.engine.kv_store import PagedKVCache
from parrot.protocol.errors import ContextTooLong

# ---------------------------------------------------------------- the pool


def test_allocate_and_free_are_lifo_and_counted():
    pool = BlockPool(4, block_size=16)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 1
    assert pool.decref([1]) == [1]
    assert pool.allocate(1) == [1]  # the most recently freed block comes back first
    pool.incref([2])
    assert pool.decref([2]) == [] and pool.refcount(2) == 1
    assert sorted(pool.decref([0, 1, 2])) == [0, 1, 2]
    assert pool.num_free == 4


def test_exhaustion_is_control_flow():
    pool = BlockPool(2)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    assert pool.allocate(3) is None
    assert pool.num_free == 2  # a failed allocation takes nothing
    assert pool.allocate(2) is not None
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_misuse_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.decref([0])
    with pytest.raises(ValueError):
        pool.incref([1])
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(4, block_size=0)


def test_blocks_for():
    pool = BlockPool(4, block_size=16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


# ------------------------------------------------------ tables and COW


BS = 4


def compute(table: ContextTable, cache: PagedKVCache, ctx: Context) -> bool:
    """Write the KV (= token ids) of all of ``ctx``'s pending tokens; False if the pool is short."""
    n = ctx.num_pending
    copies = table.reserve(ctx, n)
    if copies is None:
        return False
    cache.copy_blocks(copies)
    slots = torch.tensor(table.slots(ctx, ctx.computed_len, n), dtype=torch.long)
    values = torch.tensor(ctx.tokens(ctx.computed_len, ctx.length), dtype=torch.float32)
    cache.k_rows[0].index_copy_(0, slots, values.view(-1, 1, 1))
    cache.v_rows[0].index_copy_(0, slots, -values.view(-1, 1, 1))
    ctx.computed_len += n
    table.index_computed(ctx)  # no-op without a prefix cache
    return True


def gathered(table: ContextTable, cache: PagedKVCache, ctx: Context) -> list[float]:
    c = ctx.computed_len
    slots = torch.tensor(table.slots(ctx, 0, c), dtype=torch.long)
    return cache.k_rows[0].index_select(0, slots).view(-1).tolist()


def check_consistent(table: ContextTable, cache: PagedKVCache) -> None:
    pool = table.pool
    entries = Counter(b for ctx in table for b in ctx.block_table)
    for b in range(pool.num_blocks):
        assert pool.refcount(b) == entries.get(b, 0), f"block {b}"
    assert pool.num_free == pool.num_blocks - len(entries)
    assert len(set(pool._free)) == len(pool._free) and not set(pool._free) & set(entries)
    assert not set(pool._cached) & (set(pool._free) | set(entries)), "a cached block is neither free nor used"
    fill: dict[int, int] = {}
    for ctx in table:
        for i, b in enumerate(ctx.block_table):
            fill[b] = max(fill.get(b, 0), min(table.block_size, ctx.computed_len - i * table.block_size))
    assert table.stored_tokens() == sum(fill.values())
    for ctx in table:
        assert len(ctx.block_table) == pool.blocks_for(ctx.computed_len)
        refs = [pool.refcount(b) for b in ctx.block_table]
        assert refs == sorted(refs, reverse=True), "refcounts must not increase along a table"
        assert gathered(table, cache, ctx) == [float(t) for t in ctx.tokens(0, ctx.computed_len)]
        if table.cache is not None:
            assert len(ctx.block_hashes) == ctx.computed_len // table.block_size
    if table.cache is not None:  # every indexed block, used or cached, holds the tokens of its digest
        for digest, block in table.cache._block_of.items():
            assert table.cache._digest_of[block] == digest
            assert pool.refcount(block) > 0 or pool.is_cached(block)


class TablesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = ContextTable(10_000, pool=BlockPool(24, block_size=BS))
        self.cache = PagedKVCache(1, 24, BS, 1, 1, torch.float32, "cpu")
        self.memory = MemoryManager(self.table)
        self.next_id = 0
        self.next_token = 1

    def _tokens(self, n: int) -> list[int]:
        out = list(range(self.next_token, self.next_token + n))
        self.next_token += n
        return out

    def _pick(self, i: int) -> Context:
        ids = sorted(self.table.all_ids())
        return self.table.get(ids[i % len(ids)])

    def _grow(self, ctx: Context, n: int) -> None:
        self.table.append(ctx, self._tokens(n))
        if not compute(self.table, self.cache, ctx):
            event("pool exhausted")
            # make room the way the runner does (never from ctx itself), then retry once
            need = self.table.blocks_needed(ctx, ctx.num_pending)
            if self.memory.make_room(need, {ctx.context_id}):
                assert compute(self.table, self.cache, ctx)

    @rule(n=st.integers(0, 9))
    def new_root(self, n: int) -> None:
        self.next_id += 1
        self._grow(self.table.open(self.next_id, None), n)

    @precondition(lambda self: len(self.table) > 0)
    @rule(i=st.integers(0, 99), n=st.integers(0, 9))
    def fork(self, i: int, n: int) -> None:
        parent = self._pick(i)
        if parent.num_pending and not compute(self.table, self.cache, parent):
            return
        self.next_id += 1
        self._grow(self.table.open(self.next_id, parent.context_id), n)

    @precondition(lambda self: len(self.table) > 0)
    @rule(i=st.integers(0, 99), n=st.integers(1, 9))
    def append(self, i: int, n: int) -> None:
        self._grow(self._pick(i), n)

    @precondition(lambda self: len(self.table) > 0)
    @rule(i=st.integers(0, 99), everything=st.booleans())
    def evict(self, i: int, everything: bool) -> None:
        ctx = self._pick(i)
        if everything:
            self.table.truncate(ctx, 0)
        else:
            self.memory.drop_private(ctx)

    @precondition(lambda self: len(self.table) > 0)
    @rule(i=st.integers(0, 99))
    def rewind_one(self, i: int) -> None:
        """What a generate does when it needs the logits of a computed last token."""
        ctx = self._pick(i)
        if ctx.computed_len:
            self.table.truncate(ctx, ctx.computed_len - 1)
            if not compute(self.table, self.cache, ctx):
                event("pool exhausted on rewind")

    @precondition(lambda self: len(self.table) > 0)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        self.table.free(self._pick(i).context_id)

    @invariant()
    def consistent(self) -> None:
        check_consistent(self.table, self.cache)


TablesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_tables_stay_consistent = TablesMachine.TestCase

DOCS = [[100 + 50 * d + i for i in range(40)] for d in range(3)]


class CachedTablesMachine(TablesMachine):
    """The same operations with a prefix cache, plus roots that repeat a prefix of one of
    three documents (so later roots hit blocks earlier ones computed) and take cache hits
    before computing.  The invariants also check every hit's KV: a context's gathered
    keys must equal its tokens, so a block reused for other tokens would show."""

    def __init__(self) -> None:
        super().__init__()
        # a cache budget below the pool, so releases also evict over budget
        self.table = ContextTable(10_000, pool=BlockPool(24, block_size=BS, max_cached=8), prefix_cache=True)
        self.memory = MemoryManager(self.table)
        self.hits = 0

    @invariant()
    def the_cache_keeps_to_its_budget(self) -> None:
        assert self.table.pool.num_cached <= self.table.pool.max_cached

    @rule(d=st.integers(0, 2), n=st.integers(1, 40), tail=st.integers(0, 5))
    def new_repeating_root(self, d: int, n: int, tail: int) -> None:
        self.next_id += 1
        ctx = self.table.open(self.next_id, None)
        self.table.append(ctx, DOCS[d][:n] + self._tokens(tail))
        reused = self.table.reuse_cached(ctx)
        assert reused % BS == 0 and reused < ctx.length  # whole blocks, never the last token
        if reused:
            self.hits += 1
            event("prefix cache hit")
        if not compute(self.table, self.cache, ctx):
            need = self.table.blocks_needed(ctx, ctx.num_pending)
            if self.memory.make_room(need, {ctx.context_id}):
                assert compute(self.table, self.cache, ctx)


CachedTablesMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_tables_with_a_prefix_cache_stay_consistent = CachedTablesMachine.TestCase


def test_copy_on_write_keeps_the_shared_prefix_intact_for_every_writer():
    table = ContextTable(1000, pool=BlockPool(16, block_size=BS))
    cache = PagedKVCache(1, 16, BS, 1, 1, torch.float32, "cpu")
    parent = table.open(1, None)
    table.append(parent, [1, 2, 3, 4, 5, 6])  # block 1 is half full
    assert compute(table, cache, parent)
    kids = [table.open(10 + i, 1) for i in range(3)]
    assert all(k.block_table == parent.block_table for k in kids)
    for i, kid in enumerate(kids):
        table.append(kid, [100 * (i + 1)])
        assert compute(table, cache, kid)
    table.append(parent, [7, 8, 9])
    assert compute(table, cache, parent)
    # the full block stays shared by all four; the half-full one was copied by each writer
    # but the last, which found itself the only holder and wrote in place
    assert len({c.block_table[0] for c in [parent, *kids]}) == 1
    assert len({c.block_table[1] for c in [parent, *kids]}) == 4
    check_consistent(table, cache)


def test_make_room_evicts_least_recently_used_and_only_what_is_needed():
    table = ContextTable(1000, pool=BlockPool(8, block_size=BS))
    cache = PagedKVCache(1, 8, BS, 1, 1, torch.float32, "cpu")
    memory = MemoryManager(table)
    old, new = table.open(1, None), table.open(2, None)
    for ctx, tokens in ((old, list(range(1, 13))), (new, list(range(20, 32)))):
        table.append(ctx, tokens)
        assert compute(table, cache, ctx)
    old.last_used, new.last_used = 1, 2
    assert table.pool.num_free == 2
    assert memory.make_room(4, exclude=set())
    assert old.computed_len == 0 and new.computed_len == 12  # the least recently used went
    check_consistent(table, cache)
    assert not memory.make_room(9, exclude=set())  # more than the pool: nothing evicted
    assert new.computed_len == 12
    running = table.open(3, 2)  # a running child of `new`: the blocks they share are not candidates
    assert not memory.make_room(6, exclude={3})
    assert new.computed_len == 12  # dropping `new` alone would free nothing, so it was kept
    table.free(3)
    assert new.computed_len == 12 and running.computed_len == 0
    check_consistent(table, cache)


def test_make_room_evicts_a_retained_context_only_after_every_other_idle_one():
    """A retained context (a prefix computed ahead for a call that has not run yet) keeps
    its KV while another idle context's can go, however recently either was used."""
    table = ContextTable(1000, pool=BlockPool(8, block_size=BS))
    cache = PagedKVCache(1, 8, BS, 1, 1, torch.float32, "cpu")
    memory = MemoryManager(table)
    kept, done = table.open(1, None), table.open(2, None)
    kept.retained = True
    for ctx, tokens in ((kept, list(range(1, 13))), (done, list(range(20, 32)))):
        table.append(ctx, tokens)
        assert compute(table, cache, ctx)
    kept.last_used, done.last_used = 1, 2  # the retained one is the least recently used
    assert memory.make_room(4, exclude=set())
    assert kept.computed_len == 12 and done.computed_len == 0
    assert memory.make_room(8, exclude=set())  # nothing else left: it goes too
    assert kept.computed_len == 0
    check_consistent(table, cache)


def test_make_room_drops_idle_siblings_shared_prefix_when_it_must():
    table = ContextTable(1000, pool=BlockPool(8, block_size=BS))
    cache = PagedKVCache(1, 8, BS, 1, 1, torch.float32, "cpu")
    memory = MemoryManager(table)
    parent = table.open(1, None)
    table.append(parent, list(range(1, 9)))
    assert compute(table, cache, parent)
    kids = [table.open(2, 1), table.open(3, 1)]
    for k in kids:
        table.append(k, [50 + k.context_id] * 4)
        assert compute(table, cache, k)
    table.free(1)
    assert table.pool.num_used == 4
    assert memory.make_room(8, exclude=set())
    assert [k.computed_len for k in kids] == [0, 0]
    check_consistent(table, cache)
    for k in kids:  # the evicted KV is recomputed from the tokens, prefix included
        assert compute(table, cache, k)
    check_consistent(table, cache)


def test_context_longer_than_the_pool_is_rejected_with_a_clear_code():
    table = ContextTable(1000, pool=BlockPool(4, block_size=BS))
    ctx = table.open(1, None)
    with pytest.raises(ContextTooLong) as err:
        table.append(ctx, list(range(17)))
    assert err.value.code == "kv_capacity_exceeded"
    table.append(ctx, list(range(16)))  # exactly the pool fits
