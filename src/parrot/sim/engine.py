"""A simulated engine: the real engine's bookkeeping and step planning, a cost model for
the forward pass.

:class:`SimEngine` implements the engine interface the manager programs against
(:class:`~parrot.protocol.engine_api.EngineAPI`).  It keeps contexts in a real
:class:`~parrot.engine.core.contexts.ContextTable` over a real
:class:`~parrot.engine.core.block_pool.BlockPool` (paged KV, forks sharing blocks,
copy-on-write, the prefix cache) and plans every step with the real
:class:`~parrot.engine.core.step_planner.StepPlanner` (admission under the token
capacity and KV memory, cache hits taken at planning time, decodes first, prompt
chunks up to ``max_step_tokens``, preemption): memory limits, preemption, forks
and capacity behave as in the built-in engine.  Its step loop is the runner's
(:class:`~parrot.engine.runner.EngineRunner`): reap cancelled jobs, admit, plan
and reserve, "forward", sample.  Only the forward pass differs: the step takes
the virtual time the :class:`~parrot.sim.cost.StepCost` model gives it, and each
generate samples words of :func:`answer_vocabulary`, picked by the generate's arrival
at the engine (and the engine's ``answer_seed``) and the token's position:
answers of different calls differ, as real ones do, and quoted in a later prompt
they cost it as many tokens as they have.  No end token is ever sampled, so a
generate runs to ``max_tokens`` or the context's end: nothing stops early.

It runs as a task on the manager's event loop (no thread): on a
:class:`~parrot.sim.clock.VirtualTimeLoop` a step "takes" its time by sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from parrot.engine.core import latency_fit
from parrot.engine.core.block_pool import DEFAULT_BLOCK_SIZE, BlockPool
from parrot.engine.core.contexts import ContextTable
from parrot.engine.core.jobs import Job, check_token_ids, finish_job, reused_of
from parrot.engine.core.memory import MemoryManager
from parrot.engine.core.step_planner import DEFAULT_MAX_STEP_TOKENS, ENGINE_COUNTERS, StepPlanner
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim.cost import StepCost, step_work

__all__ = ["ANSWER_WORDS", "SimEngine", "StepRecord", "answer_vocabulary"]

DEFAULT_KV_CACHE_TOKENS = 1 << 17
"""A simulated engine's KV pool when none is given (``kv_cache_tokens=None``: a cost
profile without a pool of its own)."""

LATENCY_FACTOR = latency_fit.LATENCY_FACTOR
"""The simulated engine reports the latency cap its cost model implies at this factor
(the built-in engine's default, :mod:`parrot.engine.core.latency_fit`)."""


class StepRecord(tuple):
    """One step as it ran: ``(start, seconds, slices)``, ``slices`` the ``(context id,
    first position, tokens)`` the planner gave it, in plan order."""

    __slots__ = ()

    def __new__(cls, start: float, seconds: float, slices: tuple[tuple[int, int, int], ...]) -> StepRecord:
        return super().__new__(cls, (start, seconds, slices))


class SimEngine:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        cost: StepCost,
        *,
        model_name: str = "sim",
        max_seq_len: int = 8192,
        kv_cache_tokens: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        token_capacity: int | None = None,
        share_prefix: bool = True,
        prefix_cache: bool = True,
        record_steps: bool = False,
        answer_seed: int = 0,
    ):
        if max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self._tokenizer = tokenizer
        self.cost = cost
        self._model_name = model_name
        num_blocks = max(1, (kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS) // block_size)
        self.pool = BlockPool(num_blocks, block_size, max_cached=num_blocks // 4)
        self.contexts = ContextTable(
            max_seq_len, on_release=self._on_release, pool=self.pool, prefix_cache=prefix_cache
        )
        self.memory = MemoryManager(self.contexts)
        self._max_seq_len = min(max_seq_len, num_blocks * block_size)
        self.token_capacity = token_capacity or max(max_seq_len, 4 * max_step_tokens, num_blocks * block_size)
        self.share_prefix = share_prefix
        self.counters = dict.fromkeys(ENGINE_COUNTERS, 0)
        self.planner = StepPlanner(
            self.contexts,
            self.memory,
            lambda copies: None,
            max_step_tokens=max_step_tokens,
            counters=self.counters,
        )
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self._vocabulary = answer_vocabulary(tokenizer)
        self._answer_seed = answer_seed << 32  # engines of a run differ by it (job arrivals count per engine)
        self._arrivals = 0
        self._work = asyncio.Event()
        # held for a whole step: the runner serves calls between steps only, and so does this
        self._stepping = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------- engine interface
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> int:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        job = Job(
            context_id,
            parent_context_id,
            tokens=check_token_ids(tokens, self._tokenizer.vocab_size),
            cache_salt=cache_salt,
            priority=priority,
            retain=retain,
            on_finish=lambda err: _settle(done, err),
        )
        self._submit(job)
        try:
            await done
            return reused_of(job)
        except asyncio.CancelledError:
            self._cancel(job)
            raise

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        chunks: asyncio.Queue[GenerateChunk | ParrotError] = asyncio.Queue()
        job = Job(
            context_id,
            parent_context_id,
            sampling=sampling,
            priority=priority,
            on_chunk=chunks.put_nowait,
            on_finish=lambda err: None if err is None else chunks.put_nowait(err),
        )
        self._submit(job)
        finished = False
        try:
            while True:
                item = await chunks.get()
                if isinstance(item, ParrotError):
                    finished = True
                    raise item
                finished = item.done
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._cancel(job)

    async def free_context(self, context_id: int) -> None:
        async with self._stepping:
            ctx = self.contexts.get(context_id) if context_id in self.contexts else None
            for job in self.planner.running + self.planner.waiting:
                if job.context_id == context_id or (ctx is not None and job.ctx is ctx):
                    job.cancelled = True
            self._reap_cancelled()
            self.contexts.free(context_id)

    async def close(self) -> None:
        """Stop the step loop (a simulation's end)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def set_token_capacity(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest(f"token capacity must be a positive integer, got {n!r}", code="invalid_capacity")
        self.token_capacity = n

    async def stats(self) -> EngineStats:
        bs = self.pool.block_size
        return EngineStats(
            num_contexts=len(self.contexts),
            num_running=sum(1 for j in self.planner.running if not j.internal),
            num_waiting=len(self.planner.waiting),
            token_load=self.planner.load().total,
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
            latency_cap_tokens=self.cost.latency_cap(LATENCY_FACTOR, self.token_capacity),
            latency_cap_source="fixed",
            prefill_tokens_per_decode_step=self.cost.prefill_tokens_per_decode_step(),
            decode_path="simulated",
        )

    # ------------------------------------------------------------ the steps
    def enqueue(self, job: Job) -> None:
        """Queue ``job`` first-come first-served, as the runner's inbox does (the step loop
        is not started: :meth:`fill` and :meth:`generate` start it)."""
        self._arrivals += 1
        job.arrival = self._arrivals
        self.planner.enqueue(job)

    def _submit(self, job: Job) -> None:
        self.enqueue(job)
        self._work.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"sim engine {self._model_name}"
            )

    def _cancel(self, job: Job) -> None:
        job.cancelled = True
        if not self._stepping.locked():  # else the next step reaps it, as the runner's would
            self._reap_cancelled()

    def _on_release(self, context_id: int) -> None:
        self.planner.logits.pop(context_id, None)

    def _reap_cancelled(self) -> None:
        for job in self.planner.take_cancelled():
            finish_job(job, None, "cancelled")

    async def _loop(self) -> None:
        """Step while there is work; wait for work otherwise (the runner's loop, on asyncio)."""
        while True:
            if not (self.planner.running or self.planner.waiting):
                self._work.clear()
                await self._work.wait()
            async with self._stepping:
                await self._step()
            await asyncio.sleep(0)  # between steps, the callers' turn (the runner's inbox)

    async def _step(self) -> None:
        self._reap_cancelled()
        self.memory.tick()
        admission = self.planner.admit(self.token_capacity)
        self.counters["generates"] += len(admission.started)
        for job, error in admission.rejected:
            finish_job(job, error)
        jobs = await self._forward() if self.planner.running else []
        jobs += [j for j, _ in admission.ready if not j.preempted and not j.cancelled]
        for job in jobs:
            self._advance(job)

    async def _forward(self) -> list[Job]:
        """One planned step, taking the cost model's time; returns the generates to sample."""
        planner = self.planner
        for job in [j for j in planner.running if not j.is_generate and not j.ctx.num_pending]:  # type: ignore[union-attr]
            self._complete_fill(job)
        plan = planner.reserve(planner.plan())
        if not plan:
            return []
        seconds = self.cost.step_seconds(
            step_work((s for _, s in plan), self.pool.block_size, self.share_prefix)
        )
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self.steps is not None:
            self.steps.append(
                StepRecord(start, seconds, tuple((s.ctx.context_id, s.start, s.n) for _, s in plan))
            )
        await asyncio.sleep(seconds)
        self.counters["steps"] += 1
        generates: list[Job] = []
        for job, s in plan:
            s.ctx.computed_len += s.n
            self.contexts.index_computed(s.ctx)
            if s.ctx.num_pending or job.cancelled:
                continue
            planner.logits[s.ctx.context_id] = (s.ctx.length, None)  # type: ignore[assignment]
            if job.is_generate:
                generates.append(job)
            else:
                self._complete_fill(job)
        return generates

    def _complete_fill(self, job: Job) -> None:
        assert job.ctx is not None
        self.planner.release(job.ctx)
        self.planner.running.remove(job)
        finish_job(job, None)

    def _advance(self, job: Job) -> None:
        """The generate sampled its next token: stream it, or end at max_tokens or the context's end."""
        sp, ctx = job.sampling, job.ctx
        assert sp is not None and ctx is not None
        job.generated += 1
        self.counters["generated_tokens"] += 1
        token = self._vocabulary[_mix(self._answer_seed | job.arrival, job.generated) % len(self._vocabulary)]
        ctx.own_tokens.append(token)
        text = self._tokenizer.decode([token])
        if job.generated >= sp.max_tokens or ctx.length >= self._max_seq_len:
            self.planner.release(ctx)
            self.planner.running.remove(job)
            if job.on_chunk is not None:
                job.on_chunk(GenerateChunk(token_ids=[token], text=text, done=True, finish_reason="length"))
            finish_job(job, None)
        elif job.on_chunk is not None:
            job.on_chunk(GenerateChunk(token_ids=[token], text=text))


def _settle(fut: asyncio.Future[None], error: ParrotError | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(None)


ANSWER_WORDS = (" x", " y", " z", " w", " v", " q", " k", " j")
"""The words a simulated answer is made of, each one token in BPE vocabularies with a
leading space (a byte-level vocabulary takes them without it)."""


def answer_vocabulary(tokenizer: TextTokenizer, probe: int = 64) -> tuple[int, ...]:
    """The tokens simulated answers draw from: single tokens whose every mix of ``n``
    encodes back to ``n`` tokens, so that an answer pasted into a later prompt costs that
    prompt as many tokens as a real answer of that length would (a run of bare "x"
    merges four to a token in SmolLM2's vocabulary).  Several of them, so that answers of
    different calls differ from their first tokens on, as real ones do: answers all alike
    would make every prompt that quotes them (a reduce over its maps) a prefix-cache hit
    on the last such prompt.  The words of :data:`ANSWER_WORDS` with their space, else
    without, else the single token of "x"."""
    for words in (ANSWER_WORDS, tuple(w.strip() for w in ANSWER_WORDS)):
        ids = [tokenizer.encode(w) for w in words]
        tokens = tuple(dict.fromkeys(t[0] for t in ids if len(t) == 1))
        if len(tokens) < 2:
            continue
        mix = [tokens[_mix(7, i) % len(tokens)] for i in range(probe)]
        if len(tokenizer.encode(tokenizer.decode(mix))) == probe:
            return tokens
    return ((tokenizer.encode("x") or [0])[0],)


def _mix(answer: int, position: int) -> int:
    """A deterministic, well-spread 64-bit number of ``(answer, position)`` (splitmix64):
    which word the ``position``-th token of ``answer`` is (an answer is named by its
    engine's seed and its generate's arrival there, never by its context id: the
    manager draws those at random)."""
    z = (answer * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)
