"""The engine's worker: one thread that owns the model, the contexts and the
KV store, and runs iteration-level (continuous) batching.

Everything that touches contexts or tensors runs on the worker thread, so no
locks guard them; other threads talk to it only through :meth:`EngineRunner.call`
(run a function on the worker) and :meth:`EngineRunner.submit` (queue a job).

Each step:
1. admit waiting jobs in FIFO order; a job waits while its context (or the
   parent it forks from) is busy, and jobs on one context never overtake;
2. plan: every running job has pending tokens (a fill's prompt, or the last
   sampled token of a generate); all one-token (decode) slices go in, then
   prompt chunks up to ``max_step_tokens``;
3. one forward over the concatenated tokens;
4. jobs whose pending tokens are all computed get logits; fills finish,
   generates sample their next token (or finish on a stop condition).

The last token a generate samples stays *pending* in its context: it is
computed by the next fill on that context, or by an internal flush before a
child forks from it — never by a wasted step when the context is freed next.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parrot.engine.contexts import Context, ContextTable
from parrot.engine.kv_store import KVStore, SeqSlice, StepAttention
from parrot.engine.loader import LoadedModel
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
    ctx: Context | None = None
    cancelled: bool = False
    # generate state
    generated: int = 0
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopStringFilter | None = None

    @property
    def is_generate(self) -> bool:
        return self.sampling is not None


class EngineRunner:
    def __init__(self, loaded: LoadedModel, *, max_step_tokens: int = 512, token_capacity: int | None = None):
        if max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        self.max_seq_len = cfg.max_seq_len
        self.max_step_tokens = max_step_tokens
        self.token_capacity = token_capacity or max(cfg.max_seq_len, 4 * max_step_tokens)
        param = next(self.model.parameters())
        self.store = KVStore(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, param.dtype, str(param.device))
        self.contexts = ContextTable(cfg.max_seq_len, on_release=self._on_release)
        self._logits: dict[int, tuple[int, torch.Tensor]] = {}  # context -> (length, logits at that length)
        self._waiting: list[Job] = []
        self._running: list[Job] = []
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.counters = {"fills": 0, "filled_tokens": 0, "generates": 0, "generated_tokens": 0, "steps": 0}

    # ------------------------------------------------------------ threading
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="parrot-engine", daemon=True)
            self._thread.start()

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
        self._inbox.put(lambda: self._waiting.append(job))

    # --------------------------------------------------- worker-only methods
    def cancel(self, job: Job) -> None:
        job.cancelled = True

    def free_context(self, context_id: int) -> None:
        ctx = self.contexts.get(context_id)
        for job in self._running + self._waiting:
            if job.context_id == context_id:
                job.cancelled = True
        self._reap_cancelled()
        if ctx.busy:  # an internal flush: harmless to drop
            self._running = [j for j in self._running if j.ctx is not ctx]
            ctx.busy = False
        self.contexts.free(context_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_contexts=len(self.contexts),
            num_running=sum(1 for j in self._running if not j.internal),
            num_waiting=len(self._waiting),
            token_load=sum(j.ctx.length for j in self._running if j.ctx is not None),
            token_capacity=self.token_capacity,
            kv_tokens_used=self.contexts.stored_tokens(),
            kv_tokens_total=self.store.allocated_tokens(),
            fills=self.counters["fills"],
            filled_tokens=self.counters["filled_tokens"],
            generates=self.counters["generates"],
            generated_tokens=self.counters["generated_tokens"],
        )

    def _on_release(self, context_id: int) -> None:
        self.store.release(context_id)
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
        ready_to_sample = self._admit()
        if self._running:
            ready_to_sample += self._forward()
        if ready_to_sample:
            self._sample(ready_to_sample)

    def _reap_cancelled(self) -> None:
        for job in [j for j in self._running + self._waiting if j.cancelled]:
            if job.ctx is not None and job in self._running:
                job.ctx.busy = False
            self._finish(job, None, finish_reason="cancelled")
        self._running = [j for j in self._running if not j.cancelled]
        self._waiting = [j for j in self._waiting if not j.cancelled]

    def _admit(self) -> list[tuple[Job, torch.Tensor]]:
        """Move admissible jobs to running.  Returns generates whose first
        token can be sampled from stored logits without a forward."""
        ready: list[tuple[Job, torch.Tensor]] = []
        blocked: set[int] = set()
        still_waiting: list[Job] = []
        for job in self._waiting:
            if job.context_id in blocked or not self._admissible(job):
                blocked.add(job.context_id)
                still_waiting.append(job)
                continue
            if job.is_generate and job.parent_context_id is None and job.context_id not in self.contexts:
                self._finish(job, BadRequest(f"context {job.context_id} has no tokens to generate from"))
                continue
            try:
                ctx = self.contexts.open(job.context_id, job.parent_context_id)
                self.contexts.append(ctx, job.tokens)
            except ParrotError as exc:
                self._finish(job, exc)
                continue
            job.ctx = ctx
            ctx.busy = True
            self._running.append(job)
            if job.is_generate:
                self._start_generate(job)
                if not ctx.pending:
                    logits = self._stored_logits(ctx)
                    if logits is None:
                        self._recompute_last(job)
                    else:
                        ready.append((job, logits))
            else:
                self.counters["fills"] += 1
                self.counters["filled_tokens"] += len(job.tokens)
        self._waiting = [j for j in still_waiting if j.ctx is None and not j.cancelled]
        return [(j, lg) for j, lg in ready if j.ctx is not None and not j.cancelled]

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
        if parent.pending:  # compute the parent's last sampled token before forking
            flush = Job(pid, None, internal=True, ctx=parent)
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

    def _stored_logits(self, ctx: Context) -> torch.Tensor | None:
        hit = self._logits.get(ctx.context_id)
        if hit is not None and hit[0] == ctx.length:
            return hit[1]
        if not ctx.own_tokens and ctx.parent is not None:
            hit = self._logits.get(ctx.parent.context_id)
            if hit is not None and hit[0] == ctx.prefix_len:
                return hit[1]
        return None

    def _recompute_last(self, job: Job) -> None:
        ctx = job.ctx
        assert ctx is not None
        if ctx.num_computed == 0:
            ctx.busy = False
            self._running.remove(job)
            self._finish(job, BadRequest(f"context {ctx.context_id} has no tokens to generate from"))
            return
        ctx.num_computed -= 1  # its KV slot is rewritten by the next forward

    def _plan(self) -> list[tuple[Job, SeqSlice]]:
        plan: list[tuple[Job, SeqSlice]] = []
        budget = self.max_step_tokens
        for job in self._running:
            ctx = job.ctx
            assert ctx is not None
            if len(ctx.pending) == 1:
                plan.append((job, SeqSlice(ctx, ctx.num_computed, 1)))
                budget -= 1
        for job in self._running:
            ctx = job.ctx
            assert ctx is not None
            pending = len(ctx.pending)
            if pending > 1 and (budget > 0 or not plan):
                n = min(pending, max(budget, 1))
                plan.append((job, SeqSlice(ctx, ctx.num_computed, n)))
                budget -= n
        return plan

    def _forward(self) -> list[tuple[Job, torch.Tensor]]:
        for job in [j for j in self._running if not j.is_generate and not j.ctx.pending]:  # type: ignore[union-attr]
            self._complete_fill(job, None)  # e.g. a fill of zero tokens
        plan = self._plan()
        if not plan:
            return []
        ids: list[int] = []
        positions: list[int] = []
        for _, s in plan:
            ids.extend(s.ctx.own_tokens[s.start : s.start + s.n])
            base = s.ctx.prefix_len + s.start
            positions.extend(range(base, base + s.n))
        device = self.store.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        with torch.inference_mode():
            hidden = self.model(input_ids, pos, StepAttention(self.store, [s for _, s in plan]))
        self.counters["steps"] += 1
        finishing: list[tuple[Job, int]] = []
        row = 0
        for job, s in plan:
            row += s.n
            s.ctx.num_computed += s.n
            if not s.ctx.pending:
                finishing.append((job, row - 1))
        if not finishing:
            return []
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[[r for _, r in finishing]])
        ready: list[tuple[Job, torch.Tensor]] = []
        for (job, _), lg in zip(finishing, logits, strict=True):
            ctx = job.ctx
            assert ctx is not None
            self._logits[ctx.context_id] = (ctx.length, lg)
            if job.is_generate:
                ready.append((job, lg))
            else:
                self._complete_fill(job, None)
        return ready

    def _complete_fill(self, job: Job, error: ParrotError | None) -> None:
        assert job.ctx is not None
        job.ctx.busy = False
        self._running.remove(job)
        self._finish(job, error)

    def _sample(self, ready: list[tuple[Job, torch.Tensor]]) -> None:
        jobs = [j for j, _ in ready]
        tokens = sample(
            torch.stack([lg for _, lg in ready]),
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
        job.ctx.busy = False
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
