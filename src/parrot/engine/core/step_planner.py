"""What the engine computes in its next forward step: admission, planning, reservation.

:class:`StepPlanner` owns the engine's job queues (``waiting``, sorted by
order, and ``running``) and decides, step by step, with no forward pass and
no sampling (those are the runner's, :mod:`parrot.engine.runner`):

1. **admission** (:meth:`StepPlanner.admit`) — waiting jobs move to running
   in their *order*: priority, then first-come first-served (by arrival; a
   preempted job keeps its arrival, so it resumes before newer work of its
   priority).  The priority is the manager's, lower first: its order of the
   call's application (:meth:`parrot.manager.sched.queue_order.QueueOrder.engine_priority`);
   jobs all of priority 0 are plain first-come first-served.  A job waits while its context (or the parent
   it forks from) is busy, and jobs on one context never overtake.  Admission
   stops at the first job that does not fit the *token capacity* (the distinct
   KV tokens of running work, :class:`KVLoad`) or free KV memory (after evicting
   idle contexts' KV) — unless nothing runs, so a job larger than the capacity
   still runs alone.  What it could not admit for good (a missing context, a
   prompt over the context length) comes back as rejected, for the runner to
   fail;
2. **planning** (:meth:`StepPlanner.plan`) — every running job has pending
   tokens (a fill's prompt, the last sampled token of a generate, or KV to
   recompute).  Pending tokens whose KV the prefix cache already holds are
   taken from it first (whole blocks, by their tokens:
   :mod:`parrot.engine.core.prefix_cache`); then all one-token (decode) slices go
   in, then prompt chunks up to ``max_step_tokens``, in the jobs' order (so a
   prompt of a higher priority is computed first: prefill, which batching does
   not make cheaper, is where the order decides latency).  Taking cache hits at
   planning time, not at admission, lets calls that arrive together under one
   long prompt compute it once: the oldest computes it chunk by chunk (in
   arrival order) and the others find its blocks;
3. **reservation** (:meth:`StepPlanner.reserve`) — KV blocks for the plan in
   the jobs' order; when the pool is short, make room
   (:mod:`parrot.engine.core.memory`): evict idle contexts' KV, then preempt the
   last running jobs in that order (their private blocks go back to the pool; their KV is
   recomputed from their tokens when they resume).

Progress: a job that fits the KV pool at all is never rejected for lack of
memory; it waits or is preempted.  The first running job in order can always proceed,
because making room may evict or preempt everything else.

Runs on the engine's worker thread only, like everything that touches contexts.
No torch: the simulator (:mod:`parrot.sim`) plans its steps with the same class.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parrot.engine.core.block_pool import BlockPool
from parrot.engine.core.contexts import Context, ContextTable
from parrot.engine.core.jobs import Job
from parrot.engine.core.memory import MemoryManager
from parrot.protocol.errors import BadRequest, ParrotError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MAX_STEP_TOKENS", "Admission", "KVLoad", "SeqSlice", "StepPlanner"]

DEFAULT_MAX_STEP_TOKENS = 2048
"""Tokens of one forward step by default.  Prompt chunks of 2,048 tokens fill 32
prompts of 100 tokens at about 1.5 times the rate of 512-token chunks on the
project's 2-core Xeon (``docs/engine.md``, "Prefill"); vLLM's OpenAI server on
CPU batches 2,048 tokens a step by default too.  A step that carries a long prompt
chunk delays the decodes in it by that chunk's time."""


ENGINE_COUNTERS = (
    "fills",
    "filled_tokens",
    "generates",
    "generated_tokens",
    "steps",
    "preemptions",
    "cached_tokens",
)
"""An engine's activity counters, the real one's and the simulator's (the planner counts
fills, filled tokens, preemptions and ``cached_tokens``: pending tokens whose KV came
from the prefix cache)."""


@dataclass
class SeqSlice:
    """The new tokens of one sequence in a step: absolute positions [start, start + n)."""

    ctx: Context
    start: int
    n: int


@dataclass
class Admission:
    """What one admission pass did besides moving jobs to ``running``."""

    # generates admitted for the first time (their sampling state is to be set up)
    started: list[Job] = field(default_factory=list)
    # generates whose next token can be sampled from stored logits
    ready: list[tuple[Job, torch.Tensor]] = field(default_factory=list)
    # jobs that can never run, with why (no longer queued; the runner fails them)
    rejected: list[tuple[Job, ParrotError]] = field(default_factory=list)


class StepPlanner:
    def __init__(
        self,
        contexts: ContextTable,
        memory: MemoryManager,
        copy_blocks: Callable[[list[tuple[int, int]]], Any],
        *,
        max_step_tokens: int,
        counters: dict[str, int],
    ):
        """``copy_blocks``: copies KV blocks ``(src, dst)`` (the copy-on-write copies of
        a reservation; the KV cache's, or nothing in a simulation)."""
        self.contexts = contexts
        self.memory = memory
        self.pool: BlockPool = contexts.pool
        self.copy_blocks = copy_blocks
        self.max_step_tokens = max_step_tokens
        self.counters = counters  # the runner's: fills, filled_tokens, preemptions, cached_tokens
        self.waiting: list[Job] = []  # sorted by order (priority, arrival)
        self.running: list[Job] = []
        self.logits: dict[int, tuple[int, torch.Tensor]] = {}  # context -> (length, logits at that length)

    def load(self) -> KVLoad:
        """The distinct KV tokens the running work reads (see :class:`KVLoad`)."""
        return KVLoad.of(self.pool.block_size, (job.ctx for job in self.running if job.ctx is not None))

    def enqueue(self, job: Job) -> None:
        """A new job (its arrival already stamped, later than every other's) waits in order."""
        bisect.insort(self.waiting, job, key=_order)

    def release(self, ctx: Context) -> None:
        """A job let go of its context: it may be evicted, most recently used last."""
        ctx.busy = False
        self.memory.touch(ctx)

    def take_cancelled(self) -> list[Job]:
        """Remove the cancelled jobs from the queues (their contexts released)."""
        if not any(j.cancelled for j in self.running) and not any(j.cancelled for j in self.waiting):
            return []
        gone = [j for j in self.running + self.waiting if j.cancelled]
        for job in gone:
            if job.ctx is not None:
                self.release(job.ctx)
        self.running = [j for j in self.running if not j.cancelled]
        self.waiting = [j for j in self.waiting if not j.cancelled]
        return gone

    def take_all(self) -> list[Job]:
        """Empty the queues (their contexts no longer busy, left as they are)."""
        gone = self.running + self.waiting
        for job in gone:
            if job.ctx is not None:
                job.ctx.busy = False
        self.running, self.waiting = [], []
        return gone

    # ------------------------------------------------------------ admission
    def admit(self, token_capacity: int) -> Admission:
        """Move admissible jobs to running, in order (priority, then first-come first-served)."""
        out = Admission()
        blocked: set[int] = set()
        still_waiting: list[Job] = []
        load = self.load()
        full = False  # a job did not fit: everything behind it waits (no starvation)
        for job in self.waiting:
            if job.cancelled:
                continue
            if full or job.context_id in blocked:
                blocked.add(job.context_id)
                still_waiting.append(job)
                continue
            if job.preempted:
                ctx = job.ctx
                assert ctx is not None
                extra = load.extra(ctx.block_table, ctx.computed_len, ctx.num_pending)
                if not self._fits(job, extra, self.memory.blocks_to_compute(ctx), load.total, token_capacity):
                    full = True
                    still_waiting.append(job)
                    continue
                job.preempted = False
                self.running.append(job)
                load.add(ctx.block_table, ctx.computed_len, ctx.num_pending)
                if job.is_generate and not ctx.num_pending:
                    self._logits_or_recompute(job, out)
                continue
            if not self._admissible(job):
                blocked.add(job.context_id)
                still_waiting.append(job)
                continue
            if job.is_generate and job.parent_context_id is None and job.context_id not in self.contexts:
                out.rejected.append(
                    (job, BadRequest(f"context {job.context_id} has no tokens to generate from"))
                )
                continue
            held, computed, pending, blocks = self._prospective(job)
            if not self._fits(job, load.extra(held, computed, pending), blocks, load.total, token_capacity):
                full = True
                still_waiting.append(job)
                continue
            try:
                ctx = self._open(job)
            except ParrotError as exc:
                out.rejected.append((job, exc))
                continue
            job.ctx = ctx
            ctx.busy = True
            self.running.append(job)
            load.add(ctx.block_table, ctx.computed_len, ctx.num_pending)
            if job.is_generate:
                out.started.append(job)
                if not ctx.num_pending:
                    self._logits_or_recompute(job, out)
            else:
                self.counters["fills"] += 1
                self.counters["filled_tokens"] += len(job.tokens)
        self.waiting = still_waiting
        return out

    def _open(self, job: Job) -> Context:
        """``job``'s context with its tokens appended (created or forked if new; a new one
        is freed again if its tokens do not fit)."""
        created = job.context_id not in self.contexts
        ctx = self.contexts.open(job.context_id, job.parent_context_id, job.cache_salt)
        if created:
            ctx.retained = job.retain
        try:
            self.contexts.append(ctx, job.tokens)
        except ParrotError:
            if created:
                self.contexts.free(ctx.context_id)
            raise
        if created and ctx.parent is not None:
            hit = self.logits.get(ctx.parent.context_id)
            if hit is not None and hit[0] == ctx.prefix_len:
                self.logits[ctx.context_id] = hit  # a child generating at once samples from them
        return ctx

    def _prospective(self, job: Job) -> tuple[list[int], int, int, int]:
        """``job``'s context as it will be once its tokens are appended (creating or
        forking it if needed): (blocks it will hold, tokens computed in them, tokens
        pending, fresh blocks computing those needs at most).  A new context's leading
        tokens that the prefix cache holds count as held blocks, not as pending."""
        table, bs = self.contexts, self.pool.block_size
        n = len(job.tokens)
        _, fresh = self.memory.prospective(job.context_id, job.parent_context_id, n)
        if job.context_id in table:
            ctx = table.get(job.context_id)
            return ctx.block_table, ctx.computed_len, ctx.num_pending + n, fresh
        if job.parent_context_id in table:
            parent = table.get(job.parent_context_id)
            return parent.block_table[: self.pool.blocks_for(parent.length)], parent.length, n, fresh
        hits = table.cached_prefix(job.tokens, job.cache_salt)
        # a hit on a cached block takes it from the free count like a fresh one
        in_use = sum(1 for b in hits if not self.pool.is_cached(b))
        return hits, bs * len(hits), n - bs * len(hits), fresh - in_use

    def _fits(self, job: Job, extra: int, blocks: int, load: int, token_capacity: int) -> bool:
        """Whether ``job`` may start now: its ``extra`` distinct tokens within the token
        capacity and its blocks within KV memory (evicting idle contexts' KV if
        needed), or alone."""
        if not self.running:
            return True  # alone it always fits: making room may evict everything else
        if load + extra > token_capacity:
            return False
        exclude = {j.context_id for j in self.running} | {job.context_id, job.parent_context_id}
        return self.memory.make_room(blocks + self.memory.watermark, exclude)

    def _admissible(self, job: Job) -> bool:
        if job.context_id in self.contexts:
            return not self.contexts.get(job.context_id).busy
        pid = job.parent_context_id
        if job.is_generate and pid is None:
            return True  # admit() rejects it without creating an empty context
        if pid is None or pid not in self.contexts:
            return True  # open() reports a missing parent
        parent = self.contexts.get(pid)
        if parent.busy:
            return False
        if parent.num_pending:  # compute the parent's pending tokens before forking
            flush = Job(pid, None, internal=True, ctx=parent, arrival=job.arrival, priority=job.priority)
            parent.busy = True
            self.running.append(flush)
            return False
        return True

    def _logits_or_recompute(self, job: Job, out: Admission) -> None:
        """A running generate with nothing pending: sample from stored logits, or
        recompute the last token to get them."""
        ctx = job.ctx
        assert ctx is not None
        hit = self.logits.get(ctx.context_id)
        if hit is not None and hit[0] == ctx.length:
            out.ready.append((job, hit[1]))
            return
        if ctx.length == 0:
            self.release(ctx)
            self.running.remove(job)
            out.rejected.append((job, BadRequest(f"context {ctx.context_id} has no tokens to generate from")))
            return
        self.contexts.truncate(ctx, ctx.length - 1)  # its KV slot is rewritten by the next forward

    # ------------------------------------------------------------- planning
    def plan(self) -> list[tuple[Job, SeqSlice]]:
        """Pending tokens the prefix cache holds are taken from it; then decode slices
        (one token) first, then prompt chunks within ``max_step_tokens``.  A prompt whose
        next whole blocks an earlier chunk of this step computes waits a step and takes them
        from the cache then (calls arriving together under one prompt shorter than a step
        would otherwise each compute it in the same step), when they are at least half of
        what it has to compute."""
        decodes: list[tuple[Job, SeqSlice]] = []
        chunks: list[tuple[Job, SeqSlice]] = []
        for job in self.running:
            ctx = job.ctx
            assert ctx is not None
            if ctx.num_pending > 1:
                reused = self.contexts.reuse_cached(ctx)
                self.counters["cached_tokens"] += reused
                job.cached_tokens += reused
            if ctx.num_pending == 1:
                decodes.append((job, SeqSlice(ctx, ctx.computed_len, 1)))
        budget = self.max_step_tokens - len(decodes)
        computing: set[bytes] = set()  # digests of the whole blocks this step's chunks compute
        for job in sorted(self.running, key=_order):
            ctx = job.ctx
            assert ctx is not None
            pending = ctx.num_pending
            if pending > 1 and (budget > 0 or not (decodes or chunks)):
                if computing and self._next_block_computing(ctx, computing):
                    continue
                n = min(pending, max(budget, 1))
                (decodes if n == 1 else chunks).append((job, SeqSlice(ctx, ctx.computed_len, n)))
                budget -= n
                self._mark_computing(ctx, n, computing)
        return decodes + chunks

    def _next_block_computing(self, ctx: Context, computing: set[bytes]) -> bool:
        """Whether at least half of ``ctx``'s pending tokens are whole blocks that chunks
        already planned this step compute (same tokens from position 0): then waiting a
        step for them is worth it; for a few such blocks ahead of a long private part,
        computing them again costs less than leaving the step's budget unused."""
        bs, c = self.pool.block_size, ctx.computed_len
        if self.contexts.cache is None or c % bs or c + bs >= ctx.length:
            return False
        stop = (ctx.length - 1) // bs
        shared = 0
        for digest in self.contexts.digests_ahead(ctx, stop):
            if digest not in computing:
                break
            shared += 1
        return 2 * shared * bs >= ctx.num_pending

    def _mark_computing(self, ctx: Context, n: int, computing: set[bytes]) -> None:
        """Record the digests of the whole blocks a chunk of ``n`` tokens computes."""
        if self.contexts.cache is None:
            return
        bs, c = self.pool.block_size, ctx.computed_len
        first, stop = -(-c // bs), (c + n) // bs
        if stop > first:
            ahead = self.contexts.digests_ahead(ctx, stop)
            computing.update(ahead[first - len(ctx.block_hashes) :])

    # ---------------------------------------------------------- reservation
    def reserve(self, plan: list[tuple[Job, SeqSlice]]) -> list[tuple[Job, SeqSlice]]:
        """Give every planned slice writable blocks, first job in order first, making room
        by evicting non-running contexts' KV and then preempting the last running jobs
        in order; a job that still cannot get room is preempted itself (so work ahead
        of it can grow).  Performs the copy-on-write copies; returns the slices that got
        their blocks, in plan order."""
        copies: list[tuple[int, int]] = []
        reserved: set[int] = set()
        for job, s in sorted(plan, key=lambda p: p[0].order):
            if job.preempted:
                continue
            need = self.contexts.blocks_needed(s.ctx, s.n)
            if not self.pool.can_allocate(need):
                self._make_room(job, need)
            done = self.contexts.reserve(s.ctx, s.n)
            if done is None:
                self._preempt(job)
                continue
            copies.extend(done)
            reserved.add(id(job))
        self.copy_blocks(copies)
        return [(j, s) for j, s in plan if id(j) in reserved]

    def _make_room(self, job: Job, need: int) -> None:
        """Free ``need`` blocks for ``job``: evict non-running contexts' KV, then
        preempt running jobs after ``job`` in order, last first.  For the first
        running job in order, finally drop every non-running context's KV: some blocks it
        needs may be shared with them (a copy-on-write that is no longer needed
        once the others let go), and the oldest job must always progress."""
        running = {j.context_id for j in self.running}
        if self.memory.make_room(need, running):
            return
        for victim in sorted(self.running, key=_order, reverse=True):
            if victim.order <= job.order:
                break
            self._preempt(victim)
            running = {j.context_id for j in self.running}
            if self.memory.make_room(need, running):
                return
        if min(j.order for j in self.running) == job.order:
            self.memory.make_room(need, running, force=True)

    def _preempt(self, job: Job) -> None:
        """Recompute preemption: keep the job's shared blocks, return its private ones,
        and send it back to the waiting queue (it keeps its context and state)."""
        assert job.ctx is not None
        self.memory.drop_private(job.ctx)
        self.running.remove(job)
        job.preempted = True
        bisect.insort(self.waiting, job, key=_order)
        self.counters["preemptions"] += 1


def _order(job: Job) -> tuple[int, int]:
    return job.order


class KVLoad:
    """KV tokens a set of contexts reads: the filled rows of the distinct blocks of
    their tables (a block shared through a fork or a prefix-cache hit counts once,
    with the most rows any holder has filled) plus their pending tokens (not in a
    block yet)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.rows: dict[int, int] = {}  # block -> filled rows
        self.total = 0

    @classmethod
    def of(cls, block_size: int, contexts: Iterable[Context]) -> KVLoad:
        """The KV tokens ``contexts`` read (each as it stands: its computed and pending tokens)."""
        load = cls(block_size)
        for ctx in contexts:
            load.add(ctx.block_table, ctx.computed_len, ctx.num_pending)
        return load

    def _rows(self, blocks: list[int], computed: int) -> Iterator[tuple[int, int]]:
        bs = self.block_size
        for i, b in enumerate(blocks):
            yield b, min(bs, computed - i * bs)

    def extra(self, blocks: list[int], computed: int, pending: int) -> int:
        """Tokens that adding a context (its ``blocks``, ``computed`` tokens in them,
        ``pending`` more) would add to ``total``."""
        rows = self.rows
        return pending + sum(max(0, n - rows.get(b, 0)) for b, n in self._rows(blocks, computed))

    def add(self, blocks: list[int], computed: int, pending: int) -> None:
        rows = self.rows
        self.total += pending
        for b, n in self._rows(blocks, computed):
            have = rows.get(b, 0)
            if n > have:
                rows[b] = n
                self.total += n - have
