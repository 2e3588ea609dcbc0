"""In-process engine: the asyncio face of :class:`EngineRunner`.

Implements the engine API the manager uses (``fill`` / ``generate`` /
``free_context`` / ``stats``) with the paper's semantics:

- ``fill(tokens, context_id, parent_context_id)`` appends prompt tokens to a
  context, creating it (forked from the parent's current KV, without copying)
  if it does not exist;
- ``generate(sampling, context_id, parent_context_id)`` streams generated
  chunks; the last chunk has ``done`` set.  Closing the stream early cancels
  the generation;
- ``free_context(context_id)`` drops the context at once; KV blocks it shares
  with children stay alive through the children's references.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from parrot.engine.config import EngineConfig
from parrot.engine.core.jobs import check_token_ids, reused_of
from parrot.engine.loader import LoadedModel
from parrot.engine.runner import EngineRunner, Job
from parrot.protocol.errors import ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


class _LoopMailbox:
    """Hands items from the worker thread to one event loop, a batch per loop wake-up.

    A decode step streams a token to every running request; waking the loop once per
    token (``call_soon_threadsafe`` each) makes it compete with the next step's
    threads for the CPU once per token.  Here the first item of a batch schedules one
    wake-up and later items join it; items posted during an engine step wake the loop
    once that step has ended (``defer``: :meth:`EngineRunner.after_step`), so a step's
    tokens reach the loop in one batch, after the step's time was taken.  Invariant:
    items are delivered in the order they were posted, each exactly once.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, defer: Callable[[Callable[[], None]], bool] | None = None
    ):
        self._loop = loop
        self._defer = defer or (lambda _: False)
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._waking = False  # a wake-up is scheduled (or deferred) for the items here

    def post(self, deliver: Callable[[Any], None], item: Any) -> None:
        with self._lock:
            self._items.append((deliver, item))
            if self._waking:
                return
            self._waking = True
        if not self._defer(self._wake):
            self._wake()

    def _wake(self) -> None:
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
        for deliver, item in items:
            deliver(item)


class LocalEngine:
    """An engine in this process: an :class:`~parrot.engine.runner.EngineRunner` on its
    own thread, configured by an :class:`~parrot.engine.config.EngineConfig` (``config``,
    with keyword ``options`` naming its fields replacing them).

    The latency cap the engine reports (:mod:`parrot.engine.latency_probe`):
    with ``latency_probe`` the engine's thread times nine or more decode steps
    on fabricated contexts right after building the runner, before the
    constructor returns (no prefill; at most ``PROBE_BUDGET_S``).  It runs
    while nothing else in the process does, so its timings are as clean as the
    machine allows (run while the server started, it measured nothing usable).
    Real decode steps refine the fit.  ``latency_factor`` / ``latency_target_ms``
    set the step time the cap keeps to; ``latency_cap`` fixes the reported cap
    instead (no probe then).

    ``loaded`` may be a function that loads the model: it then runs on the engine's
    own thread, like everything else the engine does with torch (see
    :meth:`EngineRunner.start_on_own_thread`); pass a loader where speed matters.
    """

    def __init__(
        self,
        loaded: LoadedModel | Callable[[], LoadedModel],
        config: EngineConfig | None = None,
        **options: Any,
    ):
        cfg = EngineConfig.of(config, options)

        def make() -> EngineRunner:
            model = loaded if isinstance(loaded, LoadedModel) else loaded()
            runner = EngineRunner(model, cfg)
            if cfg.latency_probe and cfg.latency_cap is None:
                try:
                    runner.probe_latency()
                except Exception:  # never fatal: the cap stays unknown until real steps are timed
                    log.exception("latency probe failed")
                else:
                    _log_probe(runner)
            return runner

        self.runner = EngineRunner.start_on_own_thread(make)
        self.loaded = self.runner.loaded
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = _LoopMailbox(loop, self.runner.after_step)
        return box

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def max_seq_len(self) -> int:
        """The longest context this engine can hold: the model's context, or the whole
        KV pool if that is smaller."""
        return self.runner.max_seq_len

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.loaded.tokenizer

    @property
    def latency_cap_tokens(self) -> int:
        """The latency cap the engine reports (as in :meth:`stats`; 0 while unknown), read
        without a trip to the worker thread (for the manager's snapshots of an in-process
        engine)."""
        runner = self.runner
        return runner.latency.cap(runner.token_capacity)

    def close(self) -> None:
        self.runner.stop()

    async def _on_worker(self, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, fut, result, error)

        self.runner.call(fn, done)
        return await fut

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        return check_token_ids(tokens, self.loaded.config.vocab_size)

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
        """Append ``tokens`` (see the module); returns how many of them took their KV from
        the prefix cache instead of being computed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        job = Job(
            context_id,
            parent_context_id,
            tokens=self._check_tokens(tokens),
            cache_salt=cache_salt,
            priority=priority,
            retain=retain,
            on_finish=lambda err: loop.call_soon_threadsafe(_settle, fut, reused_of(job), err),
        )
        self.runner.submit(job)
        try:
            return await fut
        except asyncio.CancelledError:
            self.runner.call(lambda: self.runner.cancel(job), lambda *_: None)
            raise

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        mailbox = self._mailbox(asyncio.get_running_loop())
        chunks: asyncio.Queue[GenerateChunk | ParrotError] = asyncio.Queue()

        def on_finish(err: ParrotError | None) -> None:
            if err is not None:
                mailbox.post(chunks.put_nowait, err)

        job = Job(
            context_id,
            parent_context_id,
            sampling=sampling,
            priority=priority,
            on_chunk=lambda c: mailbox.post(chunks.put_nowait, c),
            on_finish=on_finish,
        )
        self.runner.submit(job)
        finished = False
        try:
            while True:
                item = await chunks.get()
                if isinstance(item, ParrotError):
                    finished = True
                    raise item
                if item.done:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.runner.call(lambda: self.runner.cancel(job), lambda *_: None)

    async def free_context(self, context_id: int) -> None:
        await self._on_worker(lambda: self.runner.free_context(context_id))

    async def set_token_capacity(self, n: int) -> None:
        """Change the token capacity (max sum of running contexts' lengths) at run
        time; new work is admitted against it from the next step on."""
        await self._on_worker(lambda: self.runner.set_token_capacity(n))

    async def stats(self) -> EngineStats:
        return await self._on_worker(self.runner.stats)

    async def context_ids(self) -> list[int]:
        return await self._on_worker(self.runner.contexts.all_ids)


def _log_probe(runner: EngineRunner) -> None:
    latency, fit = runner.latency, runner.latency.fit
    if fit is None:
        log.warning(
            "latency probe: its %.2fs of decode steps cannot place the cap (too few, or no "
            "measurable growth with load: a busy machine?); it stays unknown until real decode "
            "steps are timed",
            latency.probe_s or 0,
        )
        return
    log.info(
        "latency probe: decode step %.2f ms + %.3f ms per 1,000 tokens (%d steps, %.2fs): latency cap %d",
        fit.base_s * 1e3,
        fit.per_token_s * 1e6,
        fit.steps,
        latency.probe_s or 0,
        latency.cap(runner.token_capacity),
    )


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
