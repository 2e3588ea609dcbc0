"""The prefix tree of a decode batch, from its block tables (torch-free).

Sequences whose block tables start with the same physical blocks read the
same cached keys there (they forked from a common ancestor), so decode
attention can read such a shared run once for all of them.  This module turns
a batch's block tables into *runs*: a shared run lists every sequence under it
(nested shared prefixes give nested runs), and each sequence's remaining
tokens form one private run.

Sharing is decided by physical block identity, in whole blocks only: a run
listed by two or more sequences consists of blocks that are *full* for each
of them.  A partially filled block that was shared at a fork and then copied
on write is therefore simply private to each copy (up to ``block_size - 1``
tokens per fork point are read per sequence instead of once) — always
correct, whatever the fork offsets.

Invariants of :func:`decode_runs`' result: for every sequence ``i``, the runs
listing ``i`` are disjoint and together cover exactly its positions
``[0, lengths[i])``; every run has ``start == 0`` and ``length >= 1``; a run
listing several sequences starts at a block boundary and is a whole number of
blocks, identical at the same table indices in all their tables; ``seqs`` is
sorted.  Cost: one sort of the tables plus a binary-searched common-prefix
length per adjacent pair — C-speed list comparisons, no per-token Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """Tokens ``[start, start + length)`` of the concatenation of ``blocks``, read by ``seqs``."""

    blocks: list[int]
    start: int
    length: int
    seqs: list[int]


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def decode_runs(
    tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int, *, share: bool = True
) -> list[Run]:
    """Runs covering each sequence's ``lengths[i]`` tokens held in ``tables[i]``.

    With ``share=False`` every sequence gets one run of its whole context.
    """
    batch = len(tables)
    if not share or batch == 1:
        return [
            Run(list(tables[i][: -(-lengths[i] // block_size)]), 0, lengths[i], [i]) for i in range(batch)
        ]
    # only full blocks before the one holding a sequence's last token may be shared,
    # so every sequence keeps a non-empty private run
    full = [(n - 1) // block_size for n in lengths]
    order = sorted(range(batch), key=tables.__getitem__)
    # lcp[k]: shared full blocks of the sequences at sorted positions k-1 and k; 0 at both ends
    lcp = [0] * (batch + 1)
    for k in range(1, batch):
        a, b = order[k - 1], order[k]
        lcp[k] = _common_prefix(tables[a], tables[b], min(full[a], full[b]))
    runs: list[Run] = []

    def shared(depth: int, parent_depth: int, lb: int, rb: int) -> None:
        first = tables[order[lb]]
        runs.append(
            Run(
                list(first[parent_depth:depth]),
                0,
                (depth - parent_depth) * block_size,
                sorted(order[lb : rb + 1]),
            )
        )

    # lcp-interval tree: every interval [lb, rb] of sorted positions with common depth d
    # (> the depth of its enclosing interval) is one shared run of blocks [parent d, d).
    stack: list[tuple[int, int]] = [(0, 0)]  # (depth, left bound)
    for k in range(1, batch + 1):
        depth, lb = lcp[k], k - 1
        while depth < stack[-1][0]:
            top_depth, top_lb = stack.pop()
            shared(top_depth, max(depth, stack[-1][0]), top_lb, k - 1)
            lb = top_lb
        if depth > stack[-1][0]:
            stack.append((depth, lb))
    for k, i in enumerate(order):
        depth = max(lcp[k], lcp[k + 1])  # the deepest shared run above sequence i
        first = depth * block_size
        runs.append(Run(list(tables[i][depth : -(-lengths[i] // block_size)]), 0, lengths[i] - first, [i]))
    return runs
