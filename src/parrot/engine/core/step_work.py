"""What one engine step computes, in the terms of the simulator's cost model.

A step (:mod:`parrot.engine.core.step_planner`) computes some prompt tokens (prefill)
and one token for each decoding sequence, and its attention reads KV tokens:

* ``kv_tokens_read`` counts the KV tokens of the step's sequences; with
  ``share_prefix`` a block that several sequences share is read once (the
  shared-prefix attention), else once per sequence (per-sequence attention);
* ``prefill_pairs`` counts (query, key) pairs of the prompt chunks' causal
  attention: a chunk of ``n`` tokens starting at position ``s`` has
  ``n * s + n * (n + 1) / 2``.

The simulated engine (:mod:`parrot.sim.engine`), the calibration that times
single steps and the engine's step log (:mod:`parrot.engine.step_log`) all
compute these with :func:`step_work`, so a fitted cost means the same in each.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from parrot.engine.core.step_planner import KVLoad

__all__ = ["StepWork", "step_work"]


@dataclass(frozen=True)
class StepWork:
    """What one step computes (see the module docstring)."""

    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int
    prefill_pairs: int = 0


class _Slice(Protocol):
    """A planned slice (:class:`~parrot.engine.core.step_planner.SeqSlice`)."""

    start: int
    n: int

    @property
    def ctx(self) -> Any: ...


def step_work(slices: Iterable[_Slice], block_size: int, share_prefix: bool) -> StepWork:
    """The work of a step of these slices, planned but not yet computed (each slice's
    ``ctx.computed_len`` is still its ``start``).  A slice of one token is a decode."""
    slices = list(slices)
    prefill = sum(s.n for s in slices if s.n > 1)
    decodes = sum(1 for s in slices if s.n == 1)
    pairs = sum(s.n * s.start + s.n * (s.n + 1) // 2 for s in slices if s.n > 1)
    if share_prefix:
        read = KVLoad(block_size)
        for s in slices:
            read.add(s.ctx.block_table, s.ctx.computed_len, s.n)
        kv = read.total
    else:
        kv = sum(s.ctx.computed_len + s.n for s in slices)
    return StepWork(prefill, decodes, kv, pairs)
