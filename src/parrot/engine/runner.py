"""The engine's worker: one thread that owns the model, the contexts and the
paged KV cache, and runs iteration-level (continuous) batching.

Everything that touches contexts or tensors runs on the worker thread, so no
locks guard them; other threads talk to it only through :meth:`EngineRunner.call`
(run a function on the worker) and :meth:`EngineRunner.submit` (queue a job).

Each step:
1-3. admit waiting jobs, plan the step's slices and reserve their KV blocks
   (:mod:`parrot.engine.step_planner`: first-come first-served under a token
   capacity and free KV memory, cache hits taken at planning time, decodes
   first, then prompt chunks up to ``max_step_tokens``, preempting the newest
   work when memory runs out);
4. one forward over the concatenated tokens (:mod:`parrot.engine.paged`);
   the blocks it filled are indexed in the prefix cache;
5. jobs whose pending tokens are all computed get logits; fills finish,
   generates sample their next token (or finish on a stop condition); the rows of
   constrained generates are masked by their grammar first
   (:mod:`parrot.engine.grammar`).

The last token a generate samples stays *pending* in its context: it is
computed by the next fill on that context, or by an internal flush before a
child forks from it — never by a wasted step when the context is freed next.

A request that fits the KV pool at all is never failed for lack of memory (it
waits or is preempted); a context longer than the whole pool is rejected
(``kv_capacity_exceeded``).

Length (about 570 lines): the worker thread's step loop and its request
handling; planning (step_planner), the forward (step_forward), finishing jobs
(jobs) and grammar masks (grammar) live apart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parrot.engine import step_forward
from parrot.engine.block_pool import BlockPool
from parrot.engine.config import EngineConfig
from parrot.engine.contexts import Context, ContextTable
from parrot.engine.device import place_model, placement
from parrot.engine.grammar import GrammarCache
from parrot.engine.grammar import advance as advance_grammar
from parrot.engine.jobs import ChunkCallback, FinishCallback, Job, finish_job
from parrot.engine.kernels import kernel_set
from parrot.engine.kv_store import PagedKVCache, kv_cache_blocks
from parrot.engine.latency_probe import PREFILL_MIN_TOKENS, StepLatency, probe, step_seconds, step_start
from parrot.engine.loader import LoadedModel
from parrot.engine.memory import MemoryManager
from parrot.engine.sampler import logprobs_of, make_generator, sample
from parrot.engine.step_log import StepLog
from parrot.engine.step_planner import ENGINE_COUNTERS, KVLoad, SeqSlice, StepPlanner
from parrot.engine.step_work import StepWork, step_work
from parrot.engine.stopping import StopStringFilter
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.schemas import EngineStats, GenerateChunk, TokenLogprob

log = logging.getLogger(__name__)

__all__ = ["ChunkCallback", "EngineRunner", "FinishCallback", "Job", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What one forward step ran (passed to :attr:`EngineRunner.on_step`)."""

    num_seqs: int
    num_tokens: int
    num_running: int
    token_load: int
    kv_blocks_used: int


def _kv_cache(
    loaded: LoadedModel, cfg: EngineConfig, param: torch.Tensor, huge_pages: bool
) -> tuple[BlockPool, PagedKVCache]:
    """The block pool and the paged KV cache of ``cfg``'s size, in ``cfg.kv_dtype`` (None:
    the weights' dtype, that of ``param``) on ``param``'s device; the prefix cache may
    keep a quarter of the pool in released blocks (see BlockPool)."""
    mcfg = loaded.config
    kv_dtype = param.dtype if cfg.kv_dtype is None else cfg.kv_dtype
    if kv_dtype not in (torch.float32, torch.bfloat16, param.dtype):
        raise ValueError(f"kv_dtype must be float32, bfloat16 or the weights' dtype, not {kv_dtype}")
    num_blocks = kv_cache_blocks(
        mcfg,
        cfg.block_size,
        kv_cache_tokens=cfg.kv_cache_tokens,
        kv_cache_bytes=cfg.kv_cache_bytes,
        dtype=kv_dtype,
    )
    pool = BlockPool(num_blocks, cfg.block_size, max_cached=num_blocks // 4)
    cache = PagedKVCache(
        mcfg.num_layers,
        num_blocks,
        cfg.block_size,
        mcfg.num_kv_heads,
        mcfg.head_dim,
        kv_dtype,
        str(param.device),
        huge_pages=huge_pages,
    )
    return pool, cache


class EngineRunner:
    """The worker of one engine over ``loaded``, configured by an
    :class:`~parrot.engine.config.EngineConfig` (``config``, with keyword ``options``
    naming its fields replacing them)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, **options: Any):
        self.config = cfg = EngineConfig.of(config, options)
        max_step_tokens, weight_dtype = cfg.max_step_tokens, cfg.weight_dtype
        block_size = cfg.block_size
        self.loaded = loaded
        # The device (CUDA: a copy of the model there, no C kernels, no packing: device.py)
        self.placement = place = placement(cfg)
        self.model = place_model(loaded.model, place.device, place.dtype)
        # The kernels this engine uses, chosen once; on the CPU their build of the C ops
        # becomes the one this process's attention and fused ops find (a process
        # resource: see native.select).  Then oneDNN-packed weights on CPU (faster
        # projections: packed_linear).  Packing changes the model object, so every engine
        # sharing it runs packed, with these kernels, from now on.
        self.kernels = kernel_set.for_options(place.kernels)
        if place.device == "cpu":
            self.kernels.select()
        log.info("engine on %s (%s): %s", place.device, place.dtype, self.kernels.describe())
        self.packed = self.model.prepack(weight_dtype, self.kernels) if place.prepack else False
        if weight_dtype is not None and not self.packed:
            raise ValueError(f"cannot pack weights as {weight_dtype} here (needs CPU oneDNN)")
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.grammars = GrammarCache(self.tokenizer, mcfg.vocab_size)  # compiled constraints
        self.grammars.prepare()  # holds the GIL for up to half a second: before serving
        self.pool, self.cache = _kv_cache(loaded, cfg, next(self.model.parameters()), place.kernels.hugepages)
        num_blocks = self.pool.num_blocks
        self.contexts = ContextTable(
            mcfg.max_seq_len, on_release=self._on_release, pool=self.pool, prefix_cache=cfg.prefix_cache
        )
        self.memory = MemoryManager(self.contexts)
        self.max_seq_len = min(mcfg.max_seq_len, num_blocks * block_size)  # the longest context it can hold
        self.max_step_tokens = max_step_tokens
        self.token_capacity = self._check_capacity(
            cfg.token_capacity or max(mcfg.max_seq_len, 4 * max_step_tokens, num_blocks * block_size)
        )
        self.share_prefix = cfg.share_prefix
        self.on_step: Callable[[StepInfo], None] | None = None  # called on the worker after each forward
        # decode step time against token load, and the latency cap it implies (reported in stats)
        self.latency = StepLatency(
            factor=cfg.latency_factor, target_ms=cfg.latency_target_ms, fixed_cap=cfg.latency_cap
        )
        self._probing = False  # the latency probe is stepping fabricated contexts
        self._stepping = False  # inside _step: see after_step
        self._after_step: list[Callable[[], None]] = []
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        self._step_work: StepWork | None = None  # the logged step's work, set by _forward
        self._arrivals = 0
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.counters = dict.fromkeys(ENGINE_COUNTERS, 0)
        self.step_forward = step_forward.choose(self.model, self.cache, self.kernels, cfg.decode_attention)
        log.info("engine steps: %s", self.step_forward.name)
        # the job queues and each step's admission, plan and KV reservation
        self.planner = StepPlanner(
            self.contexts,
            self.memory,
            self.cache.copy_blocks,
            max_step_tokens=max_step_tokens,
            counters=self.counters,
        )

    # ------------------------------------------------------------ threading
    @classmethod
    def start_on_own_thread(cls, make: Callable[[], EngineRunner]) -> EngineRunner:
        """Run ``make`` (e.g. load the model and build the runner) on a new thread that then
        runs the runner's loop; returns the runner once built, or raises what ``make`` raised.

        All of the engine's torch work then happens on one thread, so PyTorch's OpenMP
        runtime keeps one thread team (it keeps one per thread that starts parallel
        work) instead of a second one left behind by the thread that loaded the model.
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

    def after_step(self, fn: Callable[[], None]) -> bool:
        """Worker thread: run ``fn`` once the step in progress has ended (after its
        tokens are sampled and its time recorded) and return True; False, and nothing
        queued, outside a step.  How :class:`~parrot.engine.local.LocalEngine` wakes an
        event loop once per step for all the tokens it streams there."""
        if not self._stepping:
            return False
        self._after_step.append(fn)
        return True

    # --------------------------------------------------- worker-only methods
    def _enqueue(self, job: Job) -> None:
        self._arrivals += 1
        job.arrival = self._arrivals
        self.planner.enqueue(job)

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
        for job in self.planner.running + self.planner.waiting:
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
        once (shared-prefix attention reads it once per step); see
        :class:`~parrot.engine.step_planner.KVLoad`."""
        return self.planner.load().total

    def has_work(self) -> bool:
        """Whether any job is running or waiting."""
        return bool(self.planner.running or self.planner.waiting)

    def stats(self) -> EngineStats:
        bs = self.pool.block_size
        return EngineStats(
            num_contexts=len(self.contexts),
            num_running=sum(1 for j in self.planner.running if not j.internal),
            num_waiting=len(self.planner.waiting),
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
            decode_path=self.step_forward.name,
            **self.latency.report(self.token_capacity),
        )

    def _on_release(self, context_id: int) -> None:
        self.planner.logits.pop(context_id, None)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            idle = not self.has_work()
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
            if not self._stopped and self.has_work():
                self._step_safely()
        self._fail_all(ParrotError("engine stopped", code="engine_stopped"))
        if self.step_log is not None:
            self.step_log.close()

    def _step_safely(self) -> None:
        try:
            self._step()
        except ParrotError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug or OOM in the step: fail the batch, keep serving
            log.exception("engine step failed")
            self._fail_all(ParrotError(f"engine step failed: {exc}", code="engine_error"))

    def _fail_all(self, error: ParrotError) -> None:
        for job in self.planner.take_all():
            self._finish(job, error)

    # ------------------------------------------------------------- stepping
    def _step(self) -> None:
        self._stepping = True
        try:
            self._step_once()
        finally:
            self._stepping = False
            deferred, self._after_step = self._after_step, []
            for fn in deferred:
                try:
                    fn()
                except Exception:  # one caller's closed loop must not keep the others waiting
                    log.exception("after-step callback failed")

    def _step_once(self) -> None:
        started = time.perf_counter()
        self._reap_cancelled()
        self.memory.tick()
        ready = self._admit()
        jobs, logits = self._forward() if self.planner.running else ([], None)
        ready = [(j, lg) for j, lg in ready if not j.preempted and not j.cancelled]
        if ready:  # rare: generates sampling from stored logits
            stored = torch.stack([lg for _, lg in ready])
            logits = stored if logits is None else torch.cat((logits, stored))
            jobs = jobs + [j for j, _ in ready]
        if jobs:
            assert logits is not None
            self._sample(jobs, logits)
        if self._step_work is not None:
            assert self.step_log is not None
            self.step_log.record(self._step_work, time.perf_counter() - started)
            self._step_work = None

    def _reap_cancelled(self) -> None:
        for job in self.planner.take_cancelled():
            self._finish(job, None, finish_reason="cancelled")

    def _release_ctx(self, ctx: Context) -> None:
        self.planner.release(ctx)

    # ------------------------------------------------------------ admission
    def _admit(self) -> list[tuple[Job, torch.Tensor]]:
        """Admit waiting jobs (:meth:`StepPlanner.admit`): set up the sampling state of
        generates that start, fail the jobs that can never run.  Returns generates whose
        next token can be sampled from stored logits."""
        admission = self.planner.admit(self.token_capacity)
        failed: set[int] = set()
        for job in admission.started:
            try:
                self._start_generate(job)
            except ParrotError as exc:  # a constraint that does not compile fails its job only
                self._end_generate(job, [], "error", error=exc)
                failed.add(id(job))
        for job, error in admission.rejected:
            self._finish(job, error)
        return [(j, lg) for j, lg in admission.ready if id(j) not in failed]

    def _start_generate(self, job: Job) -> None:
        assert job.sampling is not None and job.ctx is not None
        self.counters["generates"] += 1
        job.generator = make_generator(job.sampling.seed)
        job.decoder = self.tokenizer.incremental_decoder()
        job.stops = StopStringFilter(job.sampling.stop)
        job.counts = {} if job.sampling.penalized else None
        if job.sampling.constraint is not None:
            job.matcher = self.grammars.matcher(job.sampling.constraint)

    # -------------------------------------------------------------- forward
    def _forward(self) -> tuple[list[Job], torch.Tensor | None]:
        """One step over the planned slices.  Returns the generates whose pending
        tokens are all computed, with their logits [N, V]."""
        for job in [j for j in self.planner.running if not j.is_generate and not j.ctx.num_pending]:  # type: ignore[union-attr]
            self._complete_fill(job, None)  # e.g. a fill of zero tokens
        plan = self.planner.reserve(self.planner.plan())
        if not plan:
            return [], None
        started = step_start(self.cache.device)  # the engine thread's CPU time on the CPU
        if self.step_log is not None and not self._probing:
            self._step_work = step_work((s for _, s in plan), self.pool.block_size, self.share_prefix)
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
                attn = self.step_forward.attention(self.cache, slices, slots, share_prefix=self.share_prefix)
                hidden = self.step_forward(self.model, input_ids, pos, attn, self.cache)
        except BaseException:
            for s in slices:  # give back the blocks reserved for this step
                self.contexts.truncate(s.ctx, s.ctx.computed_len)
            raise
        return self._after_forward(plan, hidden, len(ids), started)

    def _record_prefill(self, plan: list[tuple[Job, SeqSlice]], num_tokens: int, started: float) -> None:
        """Give the latency fit a step's time when it computed enough prompt tokens to tell
        what one costs (:meth:`StepLatency.record_prefill`), with the KV its decode rows read."""
        decodes = [s for _, s in plan if s.n == 1]
        if num_tokens - len(decodes) < PREFILL_MIN_TOKENS:
            return
        decoding = KVLoad(self.pool.block_size)
        for s in decodes:
            decoding.add(s.ctx.block_table, s.ctx.computed_len, s.ctx.num_pending)
        seconds = step_seconds(started, self.cache.device)
        self.latency.record_prefill(num_tokens - len(decodes), decoding.total, len(decodes), seconds)

    def _after_forward(
        self, plan: list[tuple[Job, SeqSlice]], hidden: torch.Tensor, num_tokens: int, started: float
    ) -> tuple[list[Job], torch.Tensor | None]:
        """Account a step that ran: its KV is computed (and indexed), its decode time is
        recorded, finished fills end; returns the generates to sample, with their logits."""
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
                StepInfo(
                    len(plan), num_tokens, len(self.planner.running), self.token_load(), self.pool.num_used
                )
            )
        if num_tokens > len(plan):  # prompt tokens in it: what one costs (latency_probe)
            self._record_prefill(plan, num_tokens, started)
        if not finishing:
            return [], None
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[[r for _, r in finishing]])
        if num_tokens == len(plan):  # a pure decode step: its time is each sequence's time per token
            read = KVLoad(self.pool.block_size)
            for _, s in plan:
                read.add(s.ctx.block_table, s.ctx.computed_len, s.ctx.num_pending)
            self.latency.record(read.total, step_seconds(started, self.cache.device), probe=self._probing)
        generates: list[Job] = []
        rows: list[int] = []
        for i, ((job, _), lg) in enumerate(zip(finishing, logits, strict=True)):
            ctx = job.ctx
            assert ctx is not None
            self.planner.logits[ctx.context_id] = (ctx.length, lg)
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
        self.planner.running.remove(job)
        self._finish(job, error)

    # ------------------------------------------------------------- sampling
    def _sample(self, jobs: list[Job], logits: torch.Tensor) -> None:
        tokens = sample(
            self.grammars.mask(logits, [j.matcher for j in jobs]),
            [j.sampling for j in jobs],  # type: ignore[misc]
            [j.generator for j in jobs],
            [j.counts for j in jobs] if any(j.counts is not None for j in jobs) else None,
        ).tolist()
        eos = set(self.tokenizer.eos_token_ids)
        logprobs = logprobs_of(logits, [j.sampling for j in jobs], tokens)  # type: ignore[misc]
        for job, token, lp in zip(jobs, tokens, logprobs, strict=True):
            self._advance(job, int(token), eos, lp)

    def _advance(self, job: Job, token: int, eos: set[int], lp: TokenLogprob | None = None) -> None:
        sp, ctx = job.sampling, job.ctx
        assert sp is not None and ctx is not None and job.decoder is not None and job.stops is not None
        job.generated += 1
        self.counters["generated_tokens"] += 1
        if job.counts is not None:
            job.counts[token] = job.counts.get(token, 0) + 1
        lps = None if lp is None else [lp]
        if token in sp.stop_token_ids or (token in eos and (not sp.ignore_eos or job.matcher is not None)):
            self._end_generate(job, [token], "stop", logprobs=lps)
            return
        ctx.own_tokens.append(token)
        grammar = None if job.matcher is None else advance_grammar(job.matcher, token)
        if grammar == "error":
            error = ParrotError(
                f"constrained decoding failed: {job.matcher.get_error()}", code="grammar_error"
            )
            self._end_generate(job, [], "error", error=error)
            return
        text = job.stops.push(job.decoder.feed(token))
        if job.stops.stopped:
            self._end_generate(job, [token], "stop", text, lps)
        elif grammar == "stop":  # the grammar admits nothing more: the output is complete
            rest = job.stops.push(job.decoder.flush()) + job.stops.flush()
            self._end_generate(job, [token], "stop", text + rest, lps)
        elif job.generated >= sp.max_tokens or ctx.length >= self.max_seq_len:
            rest = job.stops.push(job.decoder.flush()) + job.stops.flush()
            self._end_generate(job, [token], "length", text + rest, lps)
        elif job.on_chunk is not None:
            job.on_chunk(GenerateChunk(token_ids=[token], text=text, logprobs=lps))

    def _end_generate(
        self,
        job: Job,
        token_ids: list[int],
        reason: str,
        text: str = "",
        logprobs: list[TokenLogprob] | None = None,
        error: ParrotError | None = None,
    ) -> None:
        """End a running generate: its last chunk (none when it failed with ``error``),
        then its caller hears it finished."""
        assert job.ctx is not None
        self._release_ctx(job.ctx)
        self.planner.running.remove(job)
        if error is not None:
            self._finish(job, error)
            return
        if job.on_chunk is not None:
            job.on_chunk(
                GenerateChunk(
                    token_ids=token_ids, text=text, done=True, finish_reason=reason, logprobs=logprobs
                )
            )
        self._finish(job, None)

    def _finish(self, job: Job, error: ParrotError | None, finish_reason: str | None = None) -> None:
        finish_job(job, error, finish_reason)
