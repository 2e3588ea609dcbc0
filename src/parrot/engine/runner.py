"""The engine's worker: one thread that owns the model, the contexts and the
paged KV cache, and runs iteration-level (continuous) batching.

Everything that touches contexts or tensors runs on the worker thread, so no
locks guard them; other threads talk to it only through :meth:`EngineRunner.call`
(run a function on the worker) and :meth:`EngineRunner.submit` (queue a job).

Each step:
1. admit waiting jobs first-come first-served (by arrival; a preempted job
   keeps its arrival, so it resumes before newer work).  A job waits while its
   context (or the parent it forks from) is busy, and jobs on one context
   never overtake.  Admission stops at the first job that does not fit the
   *token capacity* (sum of the lengths of running contexts, changeable at run
   time) or free KV memory (after evicting idle contexts' KV) — unless
   nothing runs, so a job larger than the capacity still runs alone;
2. plan: every running job has pending tokens (a fill's prompt, the last
   sampled token of a generate, or KV to recompute).  Pending tokens whose KV
   the prefix cache already holds are taken from it first (whole blocks, by
   their tokens: :mod:`parrot.engine.prefix_cache`); then all one-token
   (decode) slices go in, then prompt chunks up to ``max_step_tokens``.  Taking
   cache hits at planning time, not at admission, lets calls that arrive
   together under one long prompt compute it once: the oldest computes it
   chunk by chunk (in arrival order) and the others find its blocks;
3. reserve KV blocks for the plan in arrival order; when the pool is short,
   make room (:mod:`parrot.engine.memory`): evict idle contexts' KV, then
   preempt the newest running jobs (their private blocks go back to the pool;
   their KV is recomputed from their tokens when they resume);
4. one forward over the concatenated tokens (:mod:`parrot.engine.paged`);
   the blocks it filled are indexed in the prefix cache;
5. jobs whose pending tokens are all computed get logits; fills finish,
   generates sample their next token (or finish on a stop condition).

The last token a generate samples stays *pending* in its context: it is
computed by the next fill on that context, or by an internal flush before a
child forks from it — never by a wasted step when the context is freed next.

Progress: a request that fits the KV pool at all is never failed for lack of
memory; it waits or is preempted.  The oldest running job can always proceed,
because making room may evict or preempt everything else.  A context longer
than the whole pool is rejected (``kv_capacity_exceeded``).
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parrot.engine import decode_forward
from parrot.engine.block_pool import DEFAULT_BLOCK_SIZE, BlockPool
from parrot.engine.contexts import Context, ContextTable
from parrot.engine.kv_store import PagedKVCache, kv_cache_blocks
from parrot.engine.latency_probe import LATENCY_FACTOR, StepLatency, probe
from parrot.engine.loader import LoadedModel
from parrot.engine.memory import MemoryManager
from parrot.engine.paged import PagedStepAttention, SeqSlice
from parrot.engine.sampler import make_generator, sample
from parrot.engine.stopping import StopStringFilter
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

FinishCallback = Callable[[ParrotError | None], None]
ChunkCallback = Callable[[GenerateChunk], None]


@dataclass(eq=False)
class Job:
    """A fill (``sampling is None``) or a generate on one context."""

    context_id: int
    parent_context_id: int | None
    tokens: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    on_chunk: ChunkCallback | None = None
    on_finish: FinishCallback | None = None
    internal: bool = False  # a flush the runner made itself
    cache_salt: str = ""  # the prefix-cache salt of the context it creates (a fill's)
    ctx: Context | None = None  # set once admitted; the job then owns ``ctx.busy``
    cancelled: bool = False
    arrival: int = 0  # first-come first-served order, kept across preemptions
    preempted: bool = False  # waiting again after preemption (``ctx`` still set and busy)
    # generate state
    generated: int = 0
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopStringFilter | None = None

    @property
    def is_generate(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True)
class StepInfo:
    """What one forward step ran (passed to :attr:`EngineRunner.on_step`)."""

    num_seqs: int
    num_tokens: int
    num_running: int
    token_load: int
    kv_blocks_used: int


class EngineRunner:
    """Options: ``max_step_tokens`` — tokens of one forward step (decodes always go
    in; prompt chunks fill the rest); ``token_capacity`` — the most total tokens
    (sum of context lengths) of running work admission allows (default: the KV
    pool's size, so memory is what binds; :meth:`set_token_capacity` changes it at
    run time); ``share_prefix`` — decode attention reads a shared prefix once for
    all sequences under it (False: plain per-sequence paged attention, for
    baselines); ``prefix_cache`` — reuse the KV of any earlier prompt's leading
    whole blocks (automatic prefix caching; False for request-level baselines
    without sharing); ``block_size`` and ``kv_cache_tokens`` / ``kv_cache_bytes`` — the
    KV pool (see :func:`~parrot.engine.kv_store.kv_cache_blocks`); ``prepack`` —
    run the model's projections through oneDNN-packed weights where possible
    (see :mod:`~parrot.engine.packed_linear`); ``weight_dtype`` — pack them as this
    dtype (``torch.bfloat16``: bf16 GEMMs, opt-in) instead of the weights' own;
    ``kv_dtype`` — the KV cache's dtype (default: the weights'; ``torch.bfloat16``
    halves the bytes each decode step reads and doubles the tokens a byte budget
    holds; attention still computes in the queries' dtype); ``latency_factor``,
    ``latency_target_ms``, ``latency_cap`` — how the engine sizes the latency cap
    it reports (:mod:`parrot.engine.latency_probe`: its decode steps are timed
    against load; :meth:`probe_latency` gives a first fit at start-up)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_step_tokens: int = 512,
        token_capacity: int | None = None,
        share_prefix: bool = True,
        prefix_cache: bool = True,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
        prepack: bool = True,
        weight_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        latency_factor: float = LATENCY_FACTOR,
        latency_target_ms: float | None = None,
        latency_cap: int | None = None,
    ):
        if max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self.loaded = loaded
        self.model = loaded.model
        # oneDNN-packed weights on CPU (~3x faster projections at decode sizes).  This
        # changes the model object, so every engine sharing it runs packed from now on.
        if weight_dtype is not None and not prepack:
            raise ValueError("weight_dtype needs prepack=True")
        self.packed = self.model.prepack(weight_dtype) if prepack else False
        if weight_dtype is not None and not self.packed:
            raise ValueError(f"cannot pack weights as {weight_dtype} here (needs CPU oneDNN)")
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        param = next(self.model.parameters())
        kv_dtype = param.dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (torch.float32, torch.bfloat16, param.dtype):
            raise ValueError(f"kv_dtype must be float32, bfloat16 or the weights' dtype, not {kv_dtype}")
        num_blocks = kv_cache_blocks(
            cfg, block_size, kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=kv_cache_bytes, dtype=kv_dtype
        )
        # the prefix cache may keep a quarter of the pool in released blocks (see BlockPool)
        self.pool = BlockPool(num_blocks, block_size, max_cached=num_blocks // 4)
        self.cache = PagedKVCache(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype,
            str(param.device),
        )
        self.contexts = ContextTable(
            cfg.max_seq_len, on_release=self._on_release, pool=self.pool, prefix_cache=prefix_cache
        )
        self.memory = MemoryManager(self.contexts)
        self.max_seq_len = min(cfg.max_seq_len, num_blocks * block_size)  # the longest context it can hold
        self.max_step_tokens = max_step_tokens
        self.token_capacity = self._check_capacity(
            token_capacity or max(cfg.max_seq_len, 4 * max_step_tokens, num_blocks * block_size)
        )
        self.share_prefix = share_prefix
        self.on_step: Callable[[StepInfo], None] | None = None  # called on the worker after each forward
        # decode step time against token load, and the latency cap it implies (reported in stats)
        self.latency = StepLatency(factor=latency_factor, target_ms=latency_target_ms, fixed_cap=latency_cap)
        self._probing = False  # the latency probe is stepping fabricated contexts
        self._logits: dict[int, tuple[int, torch.Tensor]] = {}  # context -> (length, logits at that length)
        self._waiting: list[Job] = []  # sorted by arrival
        self._running: list[Job] = []
        self._arrivals = 0
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.counters = {
            "fills": 0,
            "filled_tokens": 0,
            "generates": 0,
            "generated_tokens": 0,
            "steps": 0,
            "preemptions": 0,
            "cached_tokens": 0,  # pending tokens whose KV came from the prefix cache
        }

    # ------------------------------------------------------------ threading
    @classmethod
    def start_on_own_thread(cls, make: Callable[[], EngineRunner]) -> EngineRunner:
        """Run ``make`` (e.g. load the model and build the runner) on a new thread that then
        runs the runner's loop; returns the runner once built, or raises what ``make`` raised.

        All of the engine's torch work then happens on one thread, so PyTorch's OpenMP
        runtime keeps one thread team (it keeps one per thread that starts parallel
        work).  Why: decode steps on a worker thread measured slower than on the thread
        that had loaded the model, in a scratch A/B within one process on the 2-core
        Xeon (not a committed benchmark; other runs were too noisy to confirm more).
        """
        built: list[EngineRunner] = []
        failed: list[BaseException] = []
        ready = threading.Event()

        def main() -> None:
            try:
                runner = make()
                runner._thread = threading.current_thread()
                built.append(runner)
            except BaseException as exc:  # handed to the caller below
                failed.append(exc)
                return
            finally:
                ready.set()
            runner._loop()

        threading.Thread(target=main, name="parrot-engine", daemon=True).start()
        ready.wait()
        if failed:
            raise failed[0]
        return built[0]

    def stop(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn`` on the worker thread; ``done(result, error)`` is called there."""

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the caller, never kills the worker
                done(None, exc)
            else:
                done(result, None)

        self._inbox.put(command)

    def submit(self, job: Job) -> None:
        self._inbox.put(lambda: self._enqueue(job))

    # --------------------------------------------------- worker-only methods
    def _enqueue(self, job: Job) -> None:
        self._arrivals += 1
        job.arrival = self._arrivals
        self._waiting.append(job)

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self._reap_cancelled()  # at once, so stats read next see it gone

    @staticmethod
    def _check_capacity(n: Any) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(f"token capacity must be a positive integer, got {n!r}", code="invalid_capacity")
        return n

    def set_token_capacity(self, n: int) -> None:
        """Change the token capacity; it applies to admissions from the next step on
        (running work is never preempted for it)."""
        self.token_capacity = self._check_capacity(n)

    def free_context(self, context_id: int) -> None:
        ctx = self.contexts.get(context_id)
        for job in self._running + self._waiting:
            if job.context_id == context_id or job.ctx is ctx:
                job.cancelled = True
        self._reap_cancelled()
        self.contexts.free(context_id)

    def probe_latency(self) -> None:
        """Time a few decode steps on fabricated contexts to fit the latency model at once
        (:func:`~parrot.engine.latency_probe.probe`; worker thread, idle engine, no prefill)."""
        with torch.inference_mode():
            probe(self)

    def token_load(self) -> int:
        """KV tokens the running work reads, a block shared by several running contexts
        once (shared-prefix attention reads it once per step); see :class:`_Load`."""
        return self._load().total

    def _load(self) -> _Load:
        load = _Load(self.pool.block_size)
        for job in self._running:
            if job.ctx is not None:
                load.add(job.ctx.block_table, job.ctx.computed_len, job.ctx.num_pending)
        return load

    def stats(self) -> EngineStats:
        bs = self.pool.block_size
        return EngineStats(
            num_contexts=len(self.contexts),
            num_running=sum(1 for j in self._running if not j.internal),
            num_waiting=len(self._waiting),
            token_load=self.token_load(),
            token_capacity=self.token_capacity,
            kv_tokens_used=self.contexts.stored_tokens(),
            kv_tokens_total=self.pool.num_blocks * bs,
            kv_blocks_used=self.pool.num_used,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_cached=self.pool.num_cached,
            kv_block_size=bs,
            preemptions=self.counters["preemptions"],
            fills=self.counters["fills"],
            filled_tokens=self.counters["filled_tokens"],
            generates=self.counters["generates"],
            generated_tokens=self.counters["generated_tokens"],
            cached_tokens=self.counters["cached_tokens"],
            **self.latency.report(self.token_capacity),
        )

    def _on_release(self, context_id: int) -> None:
        self._logits.pop(context_id, None)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            idle = not self._running and not self._waiting
            try:
                command = self._inbox.get() if idle else self._inbox.get_nowait()
            except queue.Empty:
                command = None
                if not self._stopped:
                    self._step_safely()
                continue
            if command is None:
                continue
            command()
            while True:  # drain everything queued before stepping
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    break
                more()
            if not self._stopped and (self._running or self._waiting):
                self._step_safely()
        self._fail_all(ParrotError("engine stopped", code="engine_stopped"))

    def _step_safely(self) -> None:
        try:
            self._step()
        except ParrotError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug or OOM in the step: fail the batch, keep serving
            log.exception("engine step failed")
            self._fail_all(ParrotError(f"engine step failed: {exc}", code="engine_error"))

    def _fail_all(self, error: ParrotError) -> None:
        for job in self._running + self._waiting:
            if job.ctx is not None:
                job.ctx.busy = False
            self._finish(job, error)
        self._running, self._waiting = [], []

    # ------------------------------------------------------------- stepping
    def _step(self) -> None:
        self._reap_cancelled()
        self.memory.tick()
        ready = self._admit()
        jobs, logits = self._forward() if self._running else ([], None)
        ready = [(j, lg) for j, lg in ready if not j.preempted and not j.cancelled]
        if ready:  # rare: generates sampling from stored logits
            stored = torch.stack([lg for _, lg in ready])
            logits = stored if logits is None else torch.cat((logits, stored))
            jobs = jobs + [j for j, _ in ready]
        if jobs:
            assert logits is not None
            self._sample(jobs, logits)

    def _reap_cancelled(self) -> None:
        if not any(j.cancelled for j in self._running) and not any(j.cancelled for j in self._waiting):
            return
        for job in [j for j in self._running + self._waiting if j.cancelled]:
            if job.ctx is not None:
                self._release_ctx(job.ctx)
            self._finish(job, None, finish_reason="cancelled")
        self._running = [j for j in self._running if not j.cancelled]
        self._waiting = [j for j in self._waiting if not j.cancelled]

    def _release_ctx(self, ctx: Context) -> None:
        ctx.busy = False
        self.memory.touch(ctx)

    # ------------------------------------------------------------ admission
    def _admit(self) -> list[tuple[Job, torch.Tensor]]:
        """Move admissible jobs to running, first-come first-served.  Returns
        generates whose next token can be sampled from stored logits."""
        ready: list[tuple[Job, torch.Tensor]] = []
        blocked: set[int] = set()
        still_waiting: list[Job] = []
        load = self._load()
        full = False  # a job did not fit: everything behind it waits (no starvation)
        for job in self._waiting:
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
                if not self._fits(job, extra, self.memory.blocks_to_compute(ctx), load.total):
                    full = True
                    still_waiting.append(job)
                    continue
                job.preempted = False
                self._running.append(job)
                load.add(ctx.block_table, ctx.computed_len, ctx.num_pending)
                if job.is_generate and not job.ctx.num_pending:
                    self._logits_or_recompute(job, ready)
                continue
            if not self._admissible(job):
                blocked.add(job.context_id)
                still_waiting.append(job)
                continue
            if job.is_generate and job.parent_context_id is None and job.context_id not in self.contexts:
                self._finish(job, BadRequest(f"context {job.context_id} has no tokens to generate from"))
                continue
            held, computed, pending, blocks = self._prospective(job)
            if not self._fits(job, load.extra(held, computed, pending), blocks, load.total):
                full = True
                still_waiting.append(job)
                continue
            created = job.context_id not in self.contexts
            try:
                ctx = self.contexts.open(job.context_id, job.parent_context_id, job.cache_salt)
                try:
                    self.contexts.append(ctx, job.tokens)
                except ParrotError:
                    if created:
                        self.contexts.free(ctx.context_id)
                    raise
            except ParrotError as exc:
                self._finish(job, exc)
                continue
            if created and ctx.parent is not None:
                hit = self._logits.get(ctx.parent.context_id)
                if hit is not None and hit[0] == ctx.prefix_len:
                    self._logits[ctx.context_id] = hit  # a child generating at once samples from them
            job.ctx = ctx
            ctx.busy = True
            self._running.append(job)
            load.add(ctx.block_table, ctx.computed_len, ctx.num_pending)
            if job.is_generate:
                self._start_generate(job)
                if not ctx.num_pending:
                    self._logits_or_recompute(job, ready)
            else:
                self.counters["fills"] += 1
                self.counters["filled_tokens"] += len(job.tokens)
        self._waiting = still_waiting
        return ready

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

    def _fits(self, job: Job, extra: int, blocks: int, load: int) -> bool:
        """Whether ``job`` may start now: its ``extra`` distinct tokens within the token
        capacity and its blocks within KV memory (evicting idle contexts' KV if
        needed), or alone."""
        if not self._running:
            return True  # alone it always fits: making room may evict everything else
        if load + extra > self.token_capacity:
            return False
        exclude = {j.context_id for j in self._running} | {job.context_id, job.parent_context_id}
        return self.memory.make_room(blocks + self.memory.watermark, exclude)

    def _admissible(self, job: Job) -> bool:
        if job.context_id in self.contexts:
            return not self.contexts.get(job.context_id).busy
        pid = job.parent_context_id
        if job.is_generate and pid is None:
            return True  # _admit rejects it without creating an empty context
        if pid is None or pid not in self.contexts:
            return True  # open() reports a missing parent
        parent = self.contexts.get(pid)
        if parent.busy:
            return False
        if parent.num_pending:  # compute the parent's pending tokens before forking
            flush = Job(pid, None, internal=True, ctx=parent, arrival=job.arrival)
            parent.busy = True
            self._running.append(flush)
            return False
        return True

    def _start_generate(self, job: Job) -> None:
        assert job.sampling is not None and job.ctx is not None
        self.counters["generates"] += 1
        job.generator = make_generator(job.sampling.seed)
        job.decoder = self.tokenizer.incremental_decoder()
        job.stops = StopStringFilter(job.sampling.stop)

    def _logits_or_recompute(self, job: Job, ready: list[tuple[Job, torch.Tensor]]) -> None:
        """A running generate with nothing pending: sample from stored logits, or
        recompute the last token to get them."""
        ctx = job.ctx
        assert ctx is not None
        hit = self._logits.get(ctx.context_id)
        if hit is not None and hit[0] == ctx.length:
            ready.append((job, hit[1]))
            return
        if ctx.length == 0:
            self._release_ctx(ctx)
            self._running.remove(job)
            self._finish(job, BadRequest(f"context {ctx.context_id} has no tokens to generate from"))
            return
        self.contexts.truncate(ctx, ctx.length - 1)  # its KV slot is rewritten by the next forward

    # ------------------------------------------------------------- planning
    def _plan(self) -> list[tuple[Job, SeqSlice]]:
        """Pending tokens the prefix cache holds are taken from it; then decode slices
        (one token) first, then prompt chunks within ``max_step_tokens``.  A prompt whose
        next whole blocks an earlier chunk of this step computes waits a step and takes them
        from the cache then (calls arriving together under one prompt shorter than a step
        would otherwise each compute it in the same step), when they are at least half of
        what it has to compute."""
        decodes: list[tuple[Job, SeqSlice]] = []
        chunks: list[tuple[Job, SeqSlice]] = []
        for job in self._running:
            ctx = job.ctx
            assert ctx is not None
            if ctx.num_pending > 1:
                self.counters["cached_tokens"] += self.contexts.reuse_cached(ctx)
            if ctx.num_pending == 1:
                decodes.append((job, SeqSlice(ctx, ctx.computed_len, 1)))
        budget = self.max_step_tokens - len(decodes)
        computing: set[bytes] = set()  # digests of the whole blocks this step's chunks compute
        for job in self._running:
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

    def _reserve(self, plan: list[tuple[Job, SeqSlice]]) -> list[tuple[Job, SeqSlice]]:
        """Give every planned slice writable blocks, oldest job first, making room by
        evicting non-running contexts' KV and then preempting the newest running
        jobs; a job that still cannot get room is preempted itself (so older work
        can grow).  Performs the copy-on-write copies; returns the slices that got
        their blocks, in plan order."""
        copies: list[tuple[int, int]] = []
        reserved: set[int] = set()
        for job, s in sorted(plan, key=lambda p: p[0].arrival):
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
        self.cache.copy_blocks(copies)
        return [(j, s) for j, s in plan if id(j) in reserved]

    def _make_room(self, job: Job, need: int) -> None:
        """Free ``need`` blocks for ``job``: evict non-running contexts' KV, then
        preempt running jobs newer than ``job``, newest first.  For the oldest
        running job, finally drop every non-running context's KV: some blocks it
        needs may be shared with them (a copy-on-write that is no longer needed
        once the others let go), and the oldest job must always progress."""
        running = {j.context_id for j in self._running}
        if self.memory.make_room(need, running):
            return
        for victim in sorted(self._running, key=lambda j: j.arrival, reverse=True):
            if victim.arrival <= job.arrival:
                break
            self._preempt(victim)
            running = {j.context_id for j in self._running}
            if self.memory.make_room(need, running):
                return
        if min(j.arrival for j in self._running) == job.arrival:
            self.memory.make_room(need, running, force=True)

    def _preempt(self, job: Job) -> None:
        """Recompute preemption: keep the job's shared blocks, return its private ones,
        and send it back to the waiting queue (it keeps its context and state)."""
        assert job.ctx is not None
        self.memory.drop_private(job.ctx)
        self._running.remove(job)
        job.preempted = True
        bisect.insort(self._waiting, job, key=lambda j: j.arrival)
        self.counters["preemptions"] += 1

    # -------------------------------------------------------------- forward
    def _forward(self) -> tuple[list[Job], torch.Tensor | None]:
        """One step over the planned slices.  Returns the generates whose pending
        tokens are all computed, with their logits [N, V]."""
        for job in [j for j in self._running if not j.is_generate and not j.ctx.num_pending]:  # type: ignore[union-attr]
            self._complete_fill(job, None)  # e.g. a fill of zero tokens
        plan = self._reserve(self._plan())
        if not plan:
            return [], None
        started = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for _, s in plan:
            ids.extend(s.ctx.tokens(s.start, s.start + s.n))
            positions.extend(range(s.start, s.start + s.n))
            slots.extend(self.contexts.slots(s.ctx, s.start, s.n))
        device = self.cache.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        slices = [s for _, s in plan]
        try:
            with torch.inference_mode():
                attn = PagedStepAttention(self.cache, slices, slots, share_prefix=self.share_prefix)
                hidden = decode_forward.run(self.model, input_ids, pos, attn, self.cache)
                if hidden is None:  # not a step the C forward takes: the model's own
                    hidden = self.model(input_ids, pos, attn)
        except BaseException:
            for s in slices:  # give back the blocks reserved for this step
                self.contexts.truncate(s.ctx, s.ctx.computed_len)
            raise
        self.counters["steps"] += 1
        finishing: list[tuple[Job, int]] = []
        row = 0
        for job, s in plan:
            row += s.n
            s.ctx.computed_len += s.n
            self.contexts.index_computed(s.ctx)
            if not s.ctx.num_pending:
                finishing.append((job, row - 1))
        if self.on_step is not None and not self._probing:
            self.on_step(
                StepInfo(len(plan), len(ids), len(self._running), self.token_load(), self.pool.num_used)
            )
        if not finishing:
            return [], None
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[[r for _, r in finishing]])
        if len(ids) == len(plan):  # a pure decode step: its time is each sequence's time per token
            read = _Load(self.pool.block_size)
            for _, s in plan:
                read.add(s.ctx.block_table, s.ctx.computed_len, s.ctx.num_pending)
            self.latency.record(read.total, time.perf_counter() - started)
        generates: list[Job] = []
        rows: list[int] = []
        for i, ((job, _), lg) in enumerate(zip(finishing, logits, strict=True)):
            ctx = job.ctx
            assert ctx is not None
            self._logits[ctx.context_id] = (ctx.length, lg)
            if job.is_generate:
                generates.append(job)
                rows.append(i)
            else:
                self._complete_fill(job, None)
        if not generates:
            return [], None
        return generates, logits if len(rows) == len(finishing) else logits[rows]

    def _complete_fill(self, job: Job, error: ParrotError | None) -> None:
        assert job.ctx is not None
        self._release_ctx(job.ctx)
        self._running.remove(job)
        self._finish(job, error)

    # ------------------------------------------------------------- sampling
    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> None:
        tokens = sample(
            logits,
            [j.sampling for j in jobs],  # type: ignore[misc]
            [j.generator for j in jobs],
        ).tolist()
        eos = set(self.tokenizer.eos_token_ids)
        for job, token in zip(jobs, tokens, strict=True):
            self._advance(job, int(token), eos)

    def _advance(self, job: Job, token: int, eos: set[int]) -> None:
        sp, ctx = job.sampling, job.ctx
        assert sp is not None and ctx is not None and job.decoder is not None and job.stops is not None
        job.generated += 1
        self.counters["generated_tokens"] += 1
        if token in sp.stop_token_ids or (token in eos and not sp.ignore_eos):
            self._end_generate(job, [token], "stop")
            return
        ctx.own_tokens.append(token)
        text = job.stops.push(job.decoder.feed(token))
        if job.stops.stopped:
            self._end_generate(job, [token], "stop", text)
        elif job.generated >= sp.max_tokens or ctx.length >= self.max_seq_len:
            self._end_generate(
                job, [token], "length", text + job.stops.push(job.decoder.flush()) + job.stops.flush()
            )
        elif job.on_chunk is not None:
            job.on_chunk(GenerateChunk(token_ids=[token], text=text))

    def _end_generate(self, job: Job, token_ids: list[int], reason: str, text: str = "") -> None:
        assert job.ctx is not None
        self._release_ctx(job.ctx)
        self._running.remove(job)
        if job.on_chunk is not None:
            job.on_chunk(GenerateChunk(token_ids=token_ids, text=text, done=True, finish_reason=reason))
        self._finish(job, None)

    def _finish(self, job: Job, error: ParrotError | None, finish_reason: str | None = None) -> None:
        if job.internal:
            return
        if finish_reason == "cancelled" and job.on_chunk is not None:
            job.on_chunk(GenerateChunk(done=True, finish_reason="cancelled"))
        if job.on_finish is not None:
            job.on_finish(error)
            job.on_finish = None


class _Load:
    """KV tokens a set of contexts reads: the filled rows of the distinct blocks of
    their tables (a block shared through a fork or a prefix-cache hit counts once,
    with the most rows any holder has filled) plus their pending tokens (not in a
    block yet)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.rows: dict[int, int] = {}  # block -> filled rows
        self.total = 0

    def _rows(self, blocks: list[int], computed: int):
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
