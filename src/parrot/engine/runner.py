"""The engine's worker: one thread that owns the model, the contexts and the
paged KV cache, and runs iteration-level (continuous) batching.

Everything that touches contexts or tensors runs on the worker thread, so no
locks guard them; other threads talk to it only through :meth:`EngineRunner.call`
(run a function on the worker) and :meth:`EngineRunner.submit` (queue a job).

Each step:
1-3. admit waiting jobs, plan the step's slices and reserve their KV blocks
   (:mod:`parrot.engine.core.step_planner`: first-come first-served under a token
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

Apart: the thread (:mod:`parrot.engine.worker`), planning, jobs and the latency
fit (:mod:`parrot.engine.core`), the forward (:mod:`parrot.engine.step_forward`),
what a sampled token does (:mod:`parrot.engine.generate`) and the latency probe's
plan (:mod:`parrot.engine.latency_probe`; the probe is :meth:`EngineRunner.probe_latency`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from parrot.engine import latency_probe, step_forward
from parrot.engine.config import EngineConfig
from parrot.engine.core.contexts import Context, ContextTable
from parrot.engine.core.jobs import ChunkCallback, FinishCallback, Job, finish_job
from parrot.engine.core.latency_fit import PREFILL_MIN_TOKENS, StepFit, StepLatency
from parrot.engine.core.memory import MemoryManager
from parrot.engine.core.step_planner import ENGINE_COUNTERS, SeqSlice, StepPlanner
from parrot.engine.core.step_work import StepWork, step_work
from parrot.engine.device import place_model, placement
from parrot.engine.generate import Ending, advance, start_generate
from parrot.engine.grammar import GrammarCache
from parrot.engine.kernels import kernel_set
from parrot.engine.kv_store import build_kv_cache
from parrot.engine.loader import LoadedModel
from parrot.engine.sampler import logprobs_of, sample
from parrot.engine.step_log import StepLog
from parrot.engine.worker import Worker
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.schemas import EngineStats, GenerateChunk, TokenLogprob

log = logging.getLogger(__name__)

_STATS_COUNTERS = ("preemptions", "fills", "filled_tokens", "generates", "generated_tokens", "cached_tokens")

__all__ = ["ChunkCallback", "EngineRunner", "FinishCallback", "Job", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What one forward step ran (passed to :attr:`EngineRunner.on_step`)."""

    num_seqs: int
    num_tokens: int
    num_running: int
    token_load: int
    kv_blocks_used: int


class EngineRunner(Worker):
    """The worker of one engine over ``loaded``, configured by an
    :class:`~parrot.engine.config.EngineConfig` (``config``, with keyword ``options``
    naming its fields replacing them)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, **options: Any):
        super().__init__()
        self.config = cfg = EngineConfig.of(config, options)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self._place_model(cfg)
        mcfg = loaded.config
        self.grammars = GrammarCache(self.tokenizer, mcfg.vocab_size)  # compiled constraints
        self.grammars.prepare()  # holds the GIL for up to half a second: before serving
        self.pool, self.cache = build_kv_cache(
            mcfg,
            cfg.block_size,
            next(self.model.parameters()),
            kv_dtype=cfg.kv_dtype,
            kv_cache_tokens=cfg.kv_cache_tokens,
            kv_cache_bytes=cfg.kv_cache_bytes,
            huge_pages=self.placement.kernels.hugepages,
        )
        kv_tokens = self.pool.num_blocks * cfg.block_size
        self.contexts = ContextTable(
            mcfg.max_seq_len, on_release=self._on_release, pool=self.pool, prefix_cache=cfg.prefix_cache
        )
        self.memory = MemoryManager(self.contexts)
        self.max_seq_len = min(mcfg.max_seq_len, kv_tokens)  # the longest context it can hold
        self.max_step_tokens = cfg.max_step_tokens
        self.token_capacity = self._check_capacity(
            cfg.token_capacity or max(mcfg.max_seq_len, 4 * cfg.max_step_tokens, kv_tokens)
        )
        self.share_prefix = cfg.share_prefix
        self.on_step: Callable[[StepInfo], None] | None = None  # called on the worker after each forward
        # decode step time against token load, and the latency cap it implies (reported in stats)
        self.latency = StepLatency(
            factor=cfg.latency_factor, target_ms=cfg.latency_target_ms, fixed_cap=cfg.latency_cap
        )
        self._probing = False  # probe_latency is stepping fabricated contexts
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        self._step_work: StepWork | None = None  # the logged step's work, set by _forward
        self._arrivals = 0
        self.counters = dict.fromkeys(ENGINE_COUNTERS, 0)
        self.step_forward = step_forward.choose(self.model, self.cache, self.kernels, cfg.decode_attention)
        log.info("engine steps: %s", self.step_forward.name)
        # the job queues and each step's admission, plan and KV reservation
        self.planner = StepPlanner(
            self.contexts,
            self.memory,
            self.cache.copy_blocks,
            max_step_tokens=cfg.max_step_tokens,
            counters=self.counters,
        )

    def _place_model(self, cfg: EngineConfig) -> None:
        """Set ``placement``, ``model``, ``kernels`` and ``packed``: the device (CUDA: a copy
        of the model there, no C kernels, no packing: device.py) and the kernels this
        engine uses, chosen once.  On the CPU their build of the C ops becomes the one this
        process's attention and fused ops find (a process resource: see native.select),
        then the weights are packed for oneDNN (faster projections: packed_linear).
        Packing changes the model object, so every engine sharing it runs packed, with
        these kernels, from now on."""
        self.placement = place = placement(cfg)
        self.model = place_model(self.loaded.model, place.device, place.dtype)
        self.kernels = kernel_set.for_options(place.kernels)
        if place.device == "cpu":
            self.kernels.select()
        log.info("engine on %s (%s): %s", place.device, place.dtype, self.kernels.describe())
        weight_dtype = cfg.weight_dtype
        self.packed = self.model.prepack(weight_dtype, self.kernels) if place.prepack else False
        if weight_dtype is not None and not self.packed:
            raise ValueError(
                f"cannot pack weights as {weight_dtype} here "
                "(needs CPU oneDNN; bf16 needs AVX-512 or AVX-NE-CONVERT)"
            )

    def submit(self, job: Job) -> None:
        """Queue ``job`` (any thread); it is admitted at a step of the worker thread."""
        self.post(lambda: self._enqueue(job))

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

    def token_load(self) -> int:
        """KV tokens the running work reads, a block shared by several running contexts
        once (shared-prefix attention reads it once per step); see
        :class:`~parrot.engine.core.step_planner.KVLoad`."""
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
            **{k: self.counters[k] for k in _STATS_COUNTERS},
            decode_path=self.step_forward.name,
            **self.latency.report(self.token_capacity),
        )

    def _on_release(self, context_id: int) -> None:
        self.planner.logits.pop(context_id, None)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        super()._loop()
        if self.step_log is not None:
            self.step_log.close()

    def _fail_all(self, error: ParrotError) -> None:
        for job in self.planner.take_all():
            self._finish(job, error)

    # ------------------------------------------------------------- stepping
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
                self._end_generate(job, Ending([], "error", error=exc))
                failed.add(id(job))
        for job, error in admission.rejected:
            self._finish(job, error)
        return [(j, lg) for j, lg in admission.ready if id(j) not in failed]

    def _start_generate(self, job: Job) -> None:
        self.counters["generates"] += 1
        start_generate(job, self.tokenizer, self.grammars)

    # -------------------------------------------------------------- forward
    def _forward(self) -> tuple[list[Job], torch.Tensor | None]:
        """One step over the planned slices.  Returns the generates whose pending
        tokens are all computed, with their logits [N, V]."""
        for job in [j for j in self.planner.running if not j.is_generate and not j.ctx.num_pending]:  # type: ignore[union-attr]
            self._complete_fill(job, None)  # e.g. a fill of zero tokens
        plan = self.planner.reserve(self.planner.plan())
        if not plan:
            return [], None
        clock = latency_probe.StepClock(self.cache.device)  # the engine thread's CPU time on the CPU
        if self.step_log is not None and not self._probing:
            self._step_work = step_work((s for _, s in plan), self.pool.block_size, self.share_prefix)
        slices = [s for _, s in plan]
        input_ids, pos, slots = step_forward.step_inputs(slices, self.contexts, self.cache.device)
        try:
            with torch.inference_mode():
                attn = self.step_forward.attention(self.cache, slices, slots, share_prefix=self.share_prefix)
                hidden = self.step_forward(self.model, input_ids, pos, attn, self.cache)
        except BaseException:
            for s in slices:  # give back the blocks reserved for this step
                self.contexts.truncate(s.ctx, s.ctx.computed_len)
            raise
        return self._after_forward(plan, hidden, len(slots), clock)

    def _after_forward(
        self,
        plan: list[tuple[Job, SeqSlice]],
        hidden: torch.Tensor,
        num_tokens: int,
        clock: latency_probe.StepClock,
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
        bs = self.pool.block_size
        if num_tokens > len(plan):  # prompt tokens in it: what one costs
            latency_probe.record_prefill_step(self.latency, [s for _, s in plan], num_tokens, bs, clock)
        if not finishing:
            return [], None
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[[r for _, r in finishing]])
        if num_tokens == len(plan):  # a pure decode step: its time is each sequence's time per token
            latency_probe.record_decode_step(
                self.latency, [s for _, s in plan], bs, clock, probe=self._probing
            )
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
        self.planner.release(job.ctx)
        self.planner.running.remove(job)
        self._finish(job, error)

    # ------------------------------------------------------------ the latency probe
    def probe_latency(self) -> StepFit | None:
        """Time decode steps at a few loads on fabricated contexts, fit them (buckets of one
        step) so that the latency cap is known at once, then time a few fabricated prompts
        (what a prompt token costs); worker thread, idle engine (else skipped), nothing
        prefilled.  The plan and its constants: :mod:`parrot.engine.latency_probe`.  Each
        step runs through :meth:`_forward`, timed and recorded into ``self.latency`` as
        the probe's; everything is freed afterwards, the counters are left as they were,
        and :attr:`on_step` and the step log do not see these steps.  Returns
        ``self.latency.fit`` (None: timings that cannot place the cap)."""
        started = time.perf_counter()
        if self.has_work():
            return self.latency.fit
        seq = latency_probe.decode_seq_tokens(self.max_seq_len, self.pool.num_free, self.pool.block_size)
        if seq < latency_probe.PROBE_MIN_SEQ_TOKENS:
            return self.latency.fit
        with torch.inference_mode():
            if not self._probe_decode(seq, started):
                return self.latency.fit
            fit = self.latency.refit(min_samples=1)
            if fit is not None:
                self._probe_prefill(started)
        self.latency.probe_s = time.perf_counter() - started
        return fit

    @contextlib.contextmanager
    def _probe_steps(self) -> Iterator[list[int]]:
        """Steps of the probe inside: not the engine's (``_probing``: no :attr:`on_step`, no
        step log; the counters restored on exit); the ids of the fabricated contexts it
        made, which the yielded list collects, are freed on exit, whatever happened."""
        made: list[int] = []
        counters = dict(self.counters)
        self._probing = True
        try:
            yield made
        finally:
            for cid in made:
                if cid in self.contexts:
                    self.contexts.free(cid)
            self.counters.update(counters)
            self._probing = False

    def _probe_job(self, ctx: Context) -> None:
        """Compute ``ctx``'s pending tokens in the next :meth:`_forward` (an internal job)."""
        ctx.busy = True
        self.planner.running.append(Job(ctx.context_id, None, internal=True, ctx=ctx))

    def _probe_decode(self, seq: int, started: float) -> bool:
        """The probe's decode steps over fabricated contexts of ``seq`` tokens; False when
        they could not run as planned (KV blocks not reserved, or a job outliving its
        step: not expected), the timings then left unfitted."""
        rounds = latency_probe.DecodeRounds(started)
        vocab = self.loaded.config.vocab_size
        with self._probe_steps() as made:
            for i in range(max(latency_probe.PROBE_SEQS)):
                made.append(cid := latency_probe.decode_context_id(i))
                tokens = latency_probe.decode_tokens(i, seq, vocab)
                if not latency_probe.fabricate_context(self.contexts, self.cache, cid, tokens):
                    return False
            for n in rounds.loads():
                for i in range(n):
                    ctx = self.contexts.get(made[i])
                    if not ctx.num_pending:
                        self.contexts.append(ctx, [latency_probe.next_token(i, ctx.length, vocab)])
                    self._probe_job(ctx)
                self.latency.last = None
                self._forward()
                if self.latency.last is not None:
                    rounds.record(n, self.latency.last[1])
                if self.planner.running:  # not expected: every fabricated job finishes in its step
                    self.planner.take_all()
                    return False
        return True

    def _probe_prefill(self, started: float) -> None:
        """Compute :data:`~parrot.engine.latency_probe.PROBE_PREFILL_STEPS` fabricated
        prompts, one a step (recorded as any step with prompt tokens:
        :meth:`StepLatency.record_prefill`), within the probe's budget, each freed after
        its step; nothing when a prompt would be under ``PREFILL_MIN_TOKENS``."""
        pool, vocab = self.pool, self.loaded.config.vocab_size
        n = latency_probe.prefill_prompt_tokens(
            self.planner.max_step_tokens, self.max_seq_len, pool.num_free, pool.block_size
        )
        if n < PREFILL_MIN_TOKENS:
            return
        with self._probe_steps():
            for step in range(latency_probe.PROBE_PREFILL_STEPS):
                if latency_probe.over_budget(started):
                    break
                cid = latency_probe.prefill_context_id(step)
                ctx = self.contexts.open(cid, None)
                try:
                    self.contexts.append(ctx, latency_probe.prompt_tokens(step, n, vocab))
                    self._probe_job(ctx)
                    self._forward()
                    if self.planner.running:  # not expected: the prompt fits one step
                        self.planner.take_all()
                        return
                finally:
                    if cid in self.contexts:
                        self.contexts.free(cid)

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
        """``token`` is ``job``'s next (:func:`~parrot.engine.generate.advance`); end the
        generate when it says so."""
        self.counters["generated_tokens"] += 1
        end = advance(job, token, eos, self.max_seq_len, lp)
        if end is not None:
            self._end_generate(job, end)

    def _end_generate(self, job: Job, end: Ending) -> None:
        """End a running generate as ``end`` says: its last chunk (none when it failed with
        ``end.error``), then its caller hears it finished."""
        assert job.ctx is not None
        self.planner.release(job.ctx)
        self.planner.running.remove(job)
        if end.error is None and job.on_chunk is not None:
            chunk = GenerateChunk(
                token_ids=end.token_ids,
                text=end.text,
                done=True,
                finish_reason=end.reason,
                logprobs=end.logprobs,
            )
            job.on_chunk(chunk)
        self._finish(job, end.error)

    def _finish(self, job: Job, error: ParrotError | None, finish_reason: str | None = None) -> None:
        finish_job(job, error, finish_reason)
