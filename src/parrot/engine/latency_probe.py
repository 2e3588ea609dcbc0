"""The start-up latency probe's plan, and the clock that times the engine's steps.

The probe itself is :meth:`parrot.engine.runner.EngineRunner.probe_latency`; what
it measures is fitted by :mod:`parrot.engine.core.latency_fit`.  This module holds
what the probe decides without touching the runner: how long its fabricated
sequences are, which load it steps next and when it stops, the token ids it
makes up, and how a fabricated context gets KV without prefilling.

- *Probe.*  The probe gives the first fit at start-up without prefilling
  anything: it fabricates contexts whose KV blocks are allocated, zeroed (so
  the memory the attention reads is real, not the kernel's shared zero page)
  and marked computed (:func:`fabricate_context`), runs decode steps through
  the engine's own forward at three loads (one, four and eight sequences of up
  to :data:`PROBE_SEQ_TOKENS` tokens: the probe assumes calls of about that
  size), three rounds or more while the machine is noisy
  (:class:`DecodeRounds`), then frees them.  It then computes
  :data:`PROBE_PREFILL_STEPS` fabricated prompts of :data:`PROBE_PREFILL_TOKENS`
  for a first figure of what a prompt token costs.
- *Clock.*  A step's time on the CPU is the engine thread's CPU time over
  the step (:func:`step_start`, :func:`step_seconds`), not the wall clock:
  the C forward and PyTorch's ops release the GIL, and another thread of
  the process (the event loop the engine streams tokens to, which runs
  beside it in ``parrot serve``) or another process may take the core or
  the GIL mid-step; waiting for them is not the engine's time.  (Helper
  threads of OpenMP work in parallel with the engine thread, which takes
  its share and waits for theirs spinning, so its CPU time covers a
  parallel region's duration.)  On CUDA the wall clock after
  synchronising.

Everything here runs on the engine's worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from parrot.engine.core.latency_fit import PREFILL_MIN_TOKENS, StepLatency
from parrot.engine.core.step_planner import KVLoad, SeqSlice

if TYPE_CHECKING:
    from parrot.engine.core.contexts import ContextTable
    from parrot.engine.kv_store import PagedKVCache

PROBE_SEQ_TOKENS = 512
"""Tokens of each fabricated sequence of the start-up probe."""

PROBE_MIN_SEQ_TOKENS = 16
"""The probe is skipped when its sequences would be shorter than this (a tiny context or KV pool)."""

PROBE_SEQS = (1, 4, 8)
"""Sequences stepped together at each of the probe's loads."""

PROBE_STEPS = 3
"""Decode steps at each probe load at least, the loads taken in turn (the lower quartile of three
is their minimum, so the first step at a load, which pays one-time costs, does not count)."""

PROBE_MAX_STEPS = 8
"""Decode steps at each probe load at most: after ``PROBE_STEPS`` rounds the probe goes on while
the two fastest steps of some load differ by more than ``PROBE_SETTLED`` (a busy machine)."""

PROBE_SETTLED = 0.2
"""See ``PROBE_MAX_STEPS``."""


PROBE_BUDGET_S = 3.0
"""The probe stops stepping once it has run this long (the engine's start waits for it): on a
machine oversubscribed by other processes a step can take seconds.  What it measured is fitted."""

PROBE_PREFILL_TOKENS = 512
"""Tokens of each fabricated prompt the probe computes (fewer where the engine's step, context
or free KV memory is smaller)."""

PROBE_PREFILL_STEPS = 2
"""Fabricated prompts the probe computes, one a step (the faster counts twice in the median of
two: the first may pay one-time costs)."""

_PROBE_CONTEXT_BASE = -1_000_000  # probe contexts get ids below this; clients use their own ids


# ------------------------------------------------------------------ the clock
def _on_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def step_start(device: str) -> float:
    """The clock reading :func:`step_seconds` measures a step on ``device`` from, taken
    (on the engine's thread) before the step's work is queued: the calling thread's CPU
    time on the CPU (see the module docstring, *Clock*), the wall clock on CUDA."""
    return time.perf_counter() if _on_cuda(device) else time.thread_time()


def step_seconds(started: float, device: str) -> float:
    """Seconds of the step since ``started`` (a :func:`step_start` reading on the same
    thread) once its work has finished on ``device``: on the CPU, the engine thread's
    CPU time (its work is done when its calls return; time spent waiting for the GIL or
    a core is not counted); a CUDA device runs kernels asynchronously, so it is
    synchronised first (else the time would be that of launching them) and the wall
    clock is read."""
    if _on_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        return time.perf_counter() - started
    return time.thread_time() - started


class StepClock:
    """The clock of one step on ``device``, started (before the step's work is queued) when
    made; :meth:`seconds` reads it once the work has finished (on CUDA it synchronises)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.started = step_start(device)

    def seconds(self) -> float:
        return step_seconds(self.started, self.device)


def record_prefill_step(
    latency: StepLatency, slices: Sequence[SeqSlice], num_tokens: int, block_size: int, clock: StepClock
) -> None:
    """Give ``latency`` a step's time when it computed enough prompt tokens to tell what one
    costs (:meth:`StepLatency.record_prefill`), with the KV its decode rows read; ``slices``
    are the step's, computed (their contexts' ``computed_len`` counts them); the clock is
    read only then."""
    decodes = [s for s in slices if s.n == 1]
    if num_tokens - len(decodes) < PREFILL_MIN_TOKENS:
        return
    decoding = KVLoad.of(block_size, (s.ctx for s in decodes))
    latency.record_prefill(num_tokens - len(decodes), decoding.total, len(decodes), clock.seconds())


def record_decode_step(
    latency: StepLatency, slices: Sequence[SeqSlice], block_size: int, clock: StepClock, *, probe: bool
) -> None:
    """Give ``latency`` a pure decode step's time (each sequence's time per token) at the KV
    load its (computed) ``slices`` read; ``probe``: a step of the start-up probe."""
    read = KVLoad.of(block_size, (s.ctx for s in slices))
    latency.record(read.total, clock.seconds(), probe=probe)


# ------------------------------------------------------------------ the plan
def over_budget(started: float) -> bool:
    """Whether a probe begun at ``started`` (a :func:`time.perf_counter` reading) has spent
    its :data:`PROBE_BUDGET_S`."""
    return time.perf_counter() - started > PROBE_BUDGET_S


def decode_seq_tokens(max_seq_len: int, free_blocks: int, block_size: int) -> int:
    """Tokens of each fabricated decode sequence: :data:`PROBE_SEQ_TOKENS`, shrunk so that
    the largest load (with the tokens its steps append) fits the context length and half
    the free KV pool.  Under :data:`PROBE_MIN_SEQ_TOKENS`: no probe."""
    grows = len(PROBE_SEQS) * PROBE_MAX_STEPS  # the most tokens one fabricated context gains
    seq = min(PROBE_SEQ_TOKENS, max_seq_len - grows - 1)
    return min(seq, (free_blocks * block_size // 2) // max(PROBE_SEQS) - grows - block_size)


def prefill_prompt_tokens(max_step_tokens: int, max_seq_len: int, free_blocks: int, block_size: int) -> int:
    """Tokens of each fabricated prompt: :data:`PROBE_PREFILL_TOKENS`, at most one step's,
    a context's and half the free KV pool's."""
    return min(PROBE_PREFILL_TOKENS, max_step_tokens, max_seq_len - 1, free_blocks * block_size // 2)


def decode_context_id(i: int) -> int:
    """The id of the ``i``-th fabricated decode context (below any client's)."""
    return _PROBE_CONTEXT_BASE - i


def prefill_context_id(step: int) -> int:
    """The id of the fabricated prompt of prefill step ``step``."""
    return _PROBE_CONTEXT_BASE - 1000 - step


def decode_tokens(i: int, seq: int, vocab: int) -> list[int]:
    """The made-up token ids of the ``i``-th fabricated decode context."""
    return [(7 * i + p) % vocab for p in range(seq)]


def next_token(i: int, length: int, vocab: int) -> int:
    """The token the ``i``-th fabricated context appends at ``length`` to be stepped again."""
    return (3 * i + length) % vocab


def prompt_tokens(step: int, n: int, vocab: int) -> list[int]:
    """The ``n`` made-up token ids of prefill step ``step``'s prompt: tokens of their own
    (no prefix-cache hit from the previous step's prompt)."""
    return [(11 * p + 5 * step + 1) % vocab for p in range(n)]


def fabricate_context(
    contexts: ContextTable, cache: PagedKVCache, context_id: int, tokens: list[int]
) -> bool:
    """Open context ``context_id`` holding ``tokens`` with KV blocks for all but the last
    token, zeroed (committed memory) and marked computed; the last token is pending.
    False when the blocks cannot be reserved (the context is left open: the caller
    frees it)."""
    import torch

    ctx = contexts.open(context_id, None)
    contexts.append(ctx, tokens)
    if contexts.reserve(ctx, len(tokens) - 1) is None:
        return False
    ctx.computed_len = len(tokens) - 1  # its KV (zeros) counts as computed
    blocks = torch.tensor(ctx.block_table, dtype=torch.long, device=cache.device)
    cache.k.index_fill_(1, blocks, 0.0)
    cache.v.index_fill_(1, blocks, 0.0)
    return True


def _settled(times: dict[int, list[float]]) -> bool:
    """Whether the two fastest steps of every load agree within ``PROBE_SETTLED``."""
    for ts in times.values():
        if len(ts) < 2:
            return False
        first, second = sorted(ts)[:2]
        if second > first * (1 + PROBE_SETTLED):
            return False
    return True


class DecodeRounds:
    """Which load (sequences stepped together) the probe steps next, and when it stops.

    The loads of :data:`PROBE_SEQS` are taken in turn, so that anything else running on
    the machine meanwhile slows every load alike: :data:`PROBE_STEPS` rounds, then more
    (up to :data:`PROBE_MAX_STEPS`) until the two fastest steps of every load agree
    within :data:`PROBE_SETTLED`; never past :data:`PROBE_BUDGET_S` from ``started``.
    """

    def __init__(self, started: float) -> None:
        self.started = started
        self.times: dict[int, list[float]] = {n: [] for n in PROBE_SEQS}

    def loads(self) -> Iterator[int]:
        """The load of each step in turn (reads the times :meth:`record` adds meanwhile)."""
        for step in range(len(PROBE_SEQS) * PROBE_MAX_STEPS):
            n = PROBE_SEQS[step % len(PROBE_SEQS)]
            if over_budget(self.started):
                return
            if n == PROBE_SEQS[0] and step >= len(PROBE_SEQS) * PROBE_STEPS and _settled(self.times):
                return
            yield n

    def record(self, n: int, seconds: float) -> None:
        """A step of ``n`` sequences took ``seconds``."""
        self.times[n].append(seconds)
