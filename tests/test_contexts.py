"""Context tree bookkeeping: forks see a fixed prefix, storage lives while referenced."""

import pytest

from parrot.engine.core.contexts import ContextTable
from parrot.protocol.errors import BadRequest, Conflict, ContextTooLong, NotFound


def make_table(max_len: int = 100):
    released: list[int] = []
    return ContextTable(max_len, on_release=released.append), released


def test_fork_sees_parent_prefix_fixed_at_fork_time():
    table, _ = make_table()
    root = table.open(1, None)
    table.append(root, [1, 2, 3])
    root.num_computed = 3
    child = table.open(2, 1)
    table.append(child, [9])
    table.append(root, [4])  # parent grows after the fork
    root.num_computed = 4
    assert child.prefix_len == 3
    assert child.length == 4
    assert [(c.context_id, n) for c, n in child.lineage()] == [(1, 3), (2, 1)]


def test_nested_forks_lineage():
    table, _ = make_table()
    a = table.open(1, None)
    table.append(a, [1, 2])
    a.num_computed = 2
    b = table.open(2, 1)
    table.append(b, [3, 4, 5])
    b.num_computed = 3
    c = table.open(3, 2)
    table.append(c, [6])
    assert c.prefix_len == 5
    assert [(x.context_id, n) for x, n in c.lineage()] == [(1, 2), (2, 3), (3, 1)]


def test_free_drops_the_context_at_once_and_children_keep_the_shared_blocks():
    table, released = make_table()
    p = table.open(1, None)
    table.append(p, list(range(40)))
    assert table.reserve(p, 40) == []  # fresh blocks: nothing to copy
    p.computed_len = 40
    shared = list(p.block_table)
    assert len(shared) == 3
    table.open(2, 1)
    c3 = table.open(3, 1)
    assert [table.pool.refcount(b) for b in shared] == [3, 3, 3]
    table.free(1)
    assert released == [1]
    assert 1 not in table  # the user can no longer address it ...
    with pytest.raises(NotFound):
        table.get(1)
    assert table.open(1, None).length == 0  # ... and may reuse its id at once
    assert [table.pool.refcount(b) for b in shared] == [2, 2, 2]  # the children's references
    assert c3.tokens(0, 40) == list(range(40))  # tokens stay known, to recompute evicted KV
    table.free(2)
    assert table.pool.num_used == 3 and table.stored_tokens() == 40
    table.free(3)
    table.free(1)
    assert released == [1, 2, 3, 1]
    assert table.pool.num_used == 0
    assert table.stored_tokens() == 0


def test_fork_requires_computed_parent_and_existing_parent():
    table, _ = make_table()
    p = table.open(1, None)
    table.append(p, [1, 2])
    with pytest.raises(Conflict, match="uncomputed"):
        table.open(2, 1)
    with pytest.raises(NotFound):
        table.open(3, 77)
    with pytest.raises(BadRequest):
        table.open(4, 4)
    assert table.all_ids() == [1]


def test_reopen_with_wrong_parent_is_a_conflict():
    table, _ = make_table()
    table.open(1, None)
    table.open(2, None)
    with pytest.raises(Conflict):
        table.open(2, 1)
    assert table.open(2, None).parent is None


def test_append_beyond_max_len_is_rejected_and_changes_nothing():
    table, _ = make_table(max_len=4)
    c = table.open(1, None)
    table.append(c, [1, 2, 3])
    with pytest.raises(ContextTooLong, match="the model's context is 4"):
        table.append(c, [4, 5])
    assert c.own_tokens == [1, 2, 3]
