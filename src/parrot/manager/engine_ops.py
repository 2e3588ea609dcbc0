"""The manager's operations on its engines: registering them, their heartbeats and
stats polls, and what the front doors may ask of the pool (which engines serve a model,
the longest context, a model's tokenizer).

:class:`EngineOperations` is one part of :class:`~parrot.manager.service.Manager`
(which inherits it), kept apart because engines are a responsibility of their own:
the routers reach the pool and the executor only through these methods.  Invariant:
whenever what an engine can take may have changed (it joined, or sent stats with
another capacity or cap), a scheduling round is asked for, so queued calls that now
fit are placed without waiting for the next event.

All it asks of the executor is such a round (:class:`SchedulingRounds`), so this module
does not import :mod:`parrot.manager.executor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.config import ManagerConfig
from parrot.protocol.engine_api import EngineAPI
from parrot.protocol.errors import BadRequest, NotFound
from parrot.protocol.schemas import EngineStats
from parrot.protocol.tokenizer import TextTokenizer

__all__ = ["EngineOperations", "SchedulingRounds"]

log = logging.getLogger(__name__)


class SchedulingRounds(Protocol):
    """What the engine operations ask of the executor
    (:class:`~parrot.manager.executor.Executor` is one)."""

    def kick(self) -> None:
        """Run a scheduling round soon; RuntimeError without a running event loop."""


class EngineOperations:
    """The engine part of :class:`~parrot.manager.service.Manager` (see the module
    docstring); it reads the manager's ``config``, ``pool`` and ``executor`` (of which
    it only asks for scheduling rounds)."""

    config: ManagerConfig
    pool: EnginePool
    executor: SchedulingRounds
    _polls: set[asyncio.Task[EngineStats]]  # stats polls of newly registered engines

    # ------------------------------------------------------------ joining
    def add_engine(
        self, api: EngineAPI, *, name: str | None = None, url: str | None = None, polled: bool | None = None
    ) -> EngineHandle:
        """Put an engine into the pool (``polled``: the manager asks for its stats instead
        of waiting for its heartbeats; by default when it has no ``url``, i.e. is
        in-process) and run a scheduling round: queued calls may fit on it."""
        handle = self.pool.register(api, name=name, url=url, polled=polled)
        self._kick()
        return handle

    def on_engine_drop(self, listener: Callable[[EngineHandle, str], None]) -> None:
        """Call ``listener(handle, reason)`` whenever an engine leaves the pool."""
        self.pool.on_drop(listener)

    def drop_stale_engines(self) -> list[str]:
        """Drop the remote engines whose heartbeats stopped; returns their ids."""
        return self.pool.drop_stale()

    def _engine_registered(self, handle: EngineHandle) -> None:
        """Poll a new polled engine's stats at once.  Without a running event loop
        (registered before the server starts) the first poll at start-up does it.

        Also computes its tokenizer's byte bound now, once (a pass over the vocabulary,
        :attr:`TextTokenizer.max_token_bytes`), not on the first request that needs it."""
        tokenizer = getattr(handle.api, "tokenizer", None)
        if isinstance(tokenizer, TextTokenizer):
            _ = tokenizer.max_token_bytes
        if not handle.polled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self.refresh_stats(handle))
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)

    # -------------------------------------------------------------- stats
    def engine_heartbeat(self, engine_id: str, stats: EngineStats) -> None:
        """A remote engine's heartbeat: record its stats and run a scheduling round.
        NotFound for an engine not in the pool; BadRequest for one whose stats the
        manager polls itself (in-process, or an external backend)."""
        if self.pool.get(engine_id).polled:
            raise BadRequest(
                f"engine {engine_id} is in-process or an external backend: the manager polls its stats itself"
            )
        self.pool.heartbeat(engine_id, stats)
        self._kick()

    async def poll_engine_stats(self) -> None:
        """One heartbeat for every polled engine (in-process or external): ask it for its
        stats and record them in the pool, where the scheduler reads them (remote engines
        send theirs)."""
        local = [h for h in self.pool if h.polled]
        await asyncio.gather(*(self.refresh_stats(h) for h in local))

    async def refresh_stats(self, handle: EngineHandle) -> EngineStats:
        """Ask a polled engine for its stats now and record them (a remote engine's are
        those of its last heartbeat).  An engine that fails to answer keeps its previous
        stats and, if external, is suspected until it answers; one dropped meanwhile is
        left alone."""
        if not handle.polled:
            return handle.stats
        try:
            stats = await handle.api.stats()
        except Exception as exc:
            log.warning("engine %s: stats poll failed: %r", handle.engine_id, exc)
            self.pool.suspect(handle.engine_id, str(getattr(exc, "message", exc)))
            return handle.stats
        caps = _caps(handle.stats)
        try:
            self.pool.heartbeat(handle.engine_id, stats)
        except NotFound:
            return stats
        if _caps(stats) != caps:
            self.executor.kick()  # queued calls may fit now
        return stats

    async def engines_with_stats(self) -> list[tuple[EngineHandle, EngineStats]]:
        """Every engine in the pool with its stats as of now (a polled engine is asked
        for them; a remote one's are those of its last heartbeat)."""
        return [(h, await self.refresh_stats(h)) for h in self.pool]

    # ------------------------------------------------------------ queries
    def engines(self) -> list[EngineHandle]:
        """The engines in the pool, answering or suspected, in the order they joined."""
        return list(self.pool)

    def engine(self, engine_id: str) -> EngineHandle:
        """The engine ``engine_id``; NotFound if it is not (or no longer) in the pool."""
        return self.pool.get(engine_id)

    def engines_serving(self, model: str | None) -> list[EngineHandle]:
        """The live engines that serve ``model`` (None: any model)."""
        return self.pool.candidates(model)

    def longest_context(self, model: str | None) -> EngineHandle | None:
        """The live engine for ``model`` (None: any) with the longest context, None if
        none: what a value or prompt must fit to be servable at all."""
        return self.pool.longest_context(model)

    def tokenizer_serving(self, model: str) -> TextTokenizer | None:
        """The tokenizer of an engine already serving ``model`` (answering or not), if any."""
        for h in self.pool:
            if h.model == model:
                return h.api.tokenizer
        return None

    def _kick(self) -> None:
        """Run a scheduling round soon (without a running event loop, e.g. an engine added
        before the server starts, none can run: the next call queued runs one)."""
        with contextlib.suppress(RuntimeError):
            self.executor.kick()


def _caps(stats: EngineStats) -> tuple[int, int, float]:
    """What of an engine's stats decides which queued calls it takes."""
    return (stats.token_capacity, stats.latency_cap_tokens, stats.prefill_tokens_per_decode_step)
